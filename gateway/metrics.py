"""Prometheus metrics of the gateway, in their own registry."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Collection, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cachegw.gateway.storage.request_record import HITS, NOT_HITS, CacheResult, RequestRecord

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class BackendCounts(Collector):
    """Per backend: requests it answered, connections it refused (each a failover to the next one), and
    whether the health probes see it up.

    The proxy counts in plain Counters (no Prometheus import there); this reads them at scrape time."""

    def __init__(
        self,
        answered: Tally[str],
        refused: Tally[str],
        urls: Sequence[str] = (),
        down: Collection[str] = frozenset(),
    ) -> None:
        self.answered, self.refused = answered, refused
        self.urls, self.down = urls, down

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        up = GaugeMetricFamily(
            "cachegw_gateway_backend_up", "1 unless the health probes marked it down", labels=["backend"]
        )
        for url in self.urls:
            up.add_metric([url], 0.0 if url in self.down else 1.0)
        yield up
        for name, doc, counts in (
            ("cachegw_gateway_backend_requests", "Requests each backend answered", self.answered),
            ("cachegw_gateway_backend_refusals", "Connections a backend refused (failovers)", self.refused),
        ):
            family = CounterMetricFamily(name, doc, labels=["backend"])
            for backend, n in sorted(counts.items()):
                family.add_metric([backend], n)
            yield family


class KvRoutingState(Collector):
    """``routing = "kv"``: per backend, the blocks its events say it holds (in its pool, in its KV tier),
    its load (running + waiting sequences) and the event gaps that dropped its entries; read at scrape
    time."""

    def __init__(
        self,
        blocks: Callable[[], dict[str, int]],
        load: Callable[[], dict[str, int]],
        lost: Callable[[], dict[str, int]],
        tiered: Callable[[], dict[str, int]] = dict,
    ) -> None:
        self._blocks, self._load, self._lost, self._tiered = blocks, load, lost, tiered

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        for family, read in (
            (GaugeMetricFamily("cachegw_gateway_kv_blocks", "KV blocks a backend's events say it holds",
                               labels=["backend"]), self._blocks),
            (GaugeMetricFamily("cachegw_gateway_kv_tier_blocks",
                               "KV blocks a backend's events say its KV tier holds (RAM, disk, Redis)",
                               labels=["backend"]), self._tiered),
            (GaugeMetricFamily("cachegw_gateway_kv_backend_load", "Sequences running + waiting on a backend",
                               labels=["backend"]), self._load),
            (CounterMetricFamily("cachegw_gateway_kv_event_losses",
                                 "Gaps in a backend's KV events no replay filled (its entries rebuilt)",
                                 labels=["backend"]), self._lost),
        ):  # fmt: skip
            for backend, n in sorted(read().items()):
                family.add_metric([backend], n)
            yield family


class AuditCounts(Collector):
    """The false-hit audits' verdicts and cost, and each scope's estimated false-hit rate, read at
    scrape time from the auditor's plain counters and the threshold provider's view."""

    def __init__(self, verdicts: Tally[str], tokens: Callable[[], int], rates: Callable[[], dict]) -> None:
        self.verdicts, self.tokens, self.rates = verdicts, tokens, rates

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        audits = CounterMetricFamily(
            "cachegw_gateway_audits",
            "False-hit audits by verdict (right, wrong, failed, dropped)",
            labels=["verdict"],
        )
        for verdict in ("right", "wrong", "failed", "dropped"):
            audits.add_metric([verdict], self.verdicts.get(verdict, 0))
        yield audits
        yield CounterMetricFamily(
            "cachegw_gateway_audit_backend_tokens",
            "Backend tokens spent re-asking audited hits",
            value=self.tokens(),
        )
        view = self.rates()
        estimate = GaugeMetricFamily(
            "cachegw_gateway_false_hit_rate_estimate",
            "Audited false-hit rate of hits at each scope's line (scope model|tenant, or overall)",
            labels=["scope"],
        )
        target = GaugeMetricFamily(
            "cachegw_gateway_false_hit_rate_target",
            "The false-hit rate each scope must stay under",
            labels=["scope"],
        )
        for scope, v in [("overall", view["overall"]), *view["by_scope"].items()]:
            if v["estimate"] is not None:
                estimate.add_metric([scope], v["estimate"])
            target.add_metric([scope], v["target"])
        yield estimate
        yield target


class GatewayMetrics:
    def __init__(
        self,
        entries: Callable[[], float],
        backends: BackendCounts | None = None,
        index_entries: Callable[[], float] | None = None,
        sync_age: Callable[[], float] | None = None,
    ) -> None:
        self.registry = r = CollectorRegistry()
        if backends is not None:
            r.register(backends)
        self.requests = Counter(
            "cachegw_gateway_requests", "Requests by cache result", ["result"], registry=r
        )
        self.by_api = Counter(
            "cachegw_gateway_api_requests",
            "Requests by the API the client called (chat, completions, responses, messages, embeddings)"
            " and cache result",
            ["api", "result"],
            registry=r,
        )
        self.lookup = Histogram(
            "cachegw_gateway_lookup_seconds", "Cache lookup time", buckets=_BUCKETS, registry=r
        )
        self.embedding = Histogram(
            "cachegw_gateway_embedding_seconds", "Query embedding time", buckets=_BUCKETS, registry=r
        )
        self.backend = Histogram(
            "cachegw_gateway_backend_seconds", "Backend time of misses", buckets=_BUCKETS, registry=r
        )
        self.total = Histogram(
            "cachegw_gateway_request_seconds",
            "Gateway time by result",
            ["result"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "cachegw_gateway_backend_prompt_tokens", "Prompt tokens sent to backends", registry=r
        )
        self.cached_tokens = Counter(
            "cachegw_gateway_backend_cached_prompt_tokens",
            "Prompt tokens the backends served from their prefix cache",
            registry=r,
        )
        self.kv_routes = Counter(
            "cachegw_gateway_kv_routes",
            'routing = "kv": misses by why their backend was picked (prefix, load, hash)',
            ["reason"],
            registry=r,
        )
        self.kv_expected = Counter(
            "cachegw_gateway_kv_expected_cached_tokens",
            'routing = "kv": prompt tokens the picked backend was expected to hold, by reason',
            ["reason"],
            registry=r,
        )
        self.kv_cached = Counter(
            "cachegw_gateway_kv_cached_tokens",
            'routing = "kv": prompt tokens the picked backend then reported cached, by reason',
            ["reason"],
            registry=r,
        )
        self.similarity = Histogram(
            "cachegw_gateway_nearest_similarity",
            "Similarity of the nearest cached query, for semantic hits and misses",
            ["result"],
            buckets=tuple(round(0.5 + 0.05 * i, 2) for i in range(10)) + (0.98, 0.99, 1.0),
            registry=r,
        )
        self.feedback = Counter("cachegw_gateway_bad_hits_flagged", "Hits reported bad", registry=r)
        self.errors = Counter(
            "cachegw_gateway_errors",
            "Requests answered with an OpenAI-style error (bad input, unknown model, backend down...)",
            ["status", "code"],
            registry=r,
        )
        self.entries = Gauge("cachegw_gateway_cache_entries", "Entries in the response cache", registry=r)
        self.entries.set_function(entries)
        self.hit_ratio = Gauge("cachegw_gateway_hit_ratio", "Exact and semantic hits / requests", registry=r)
        self.hit_ratio.set_function(self._hit_ratio)
        for name, doc, fn in (
            ("cachegw_gateway_index_entries", "Vectors in this replica's index", index_entries),
            # grows when syncing with other replicas fails (docs/replicas.md): alert on it
            ("cachegw_gateway_sync_age_seconds", "Seconds since this replica's last sync", sync_age),
        ):
            if fn is not None:
                Gauge(name, doc, registry=r).set_function(fn)

    def watch_kv(
        self,
        blocks: Callable[[], dict[str, int]],
        load: Callable[[], dict[str, int]],
        lost: Callable[[], dict[str, int]],
        tiered: Callable[[], dict[str, int]] = dict,
    ) -> None:
        self.registry.register(KvRoutingState(blocks, load, lost, tiered))

    def watch_audits(
        self, verdicts: Tally[str], tokens: Callable[[], int], rates: Callable[[], dict]
    ) -> None:
        self.registry.register(AuditCounts(verdicts, tokens, rates))

    def _hit_ratio(self) -> float:
        counts = {
            s.labels["result"]: s.value
            for m in self.requests.collect()
            for s in m.samples
            if s.name.endswith("_total")
        }
        total = sum(counts.values())
        return sum(counts.get(result, 0) for result in HITS) / total if total else 0.0

    def observe_request(self, r: RequestRecord) -> None:
        """Count a finished request by its result: latency, similarity, a backend's prompt tokens."""
        self.requests.labels(r.cache_result.value).inc()
        self.by_api.labels(r.api or "chat", r.cache_result.value).inc()
        if r.similarity is not None and r.cache_result != CacheResult.EXACT_HIT:
            self.similarity.labels(r.cache_result.value).observe(r.similarity)
        self.total.labels(r.cache_result.value).observe(r.total_ms / 1e3)
        if r.cache_result in NOT_HITS:
            self.prompt_tokens.inc(r.prompt_tokens or 0)
            self.cached_tokens.inc(r.cached_tokens or 0)
        if r.route is not None:
            self.kv_routes.labels(r.route).inc()
            self.kv_expected.labels(r.route).inc(r.expected_cached_tokens or 0)
            self.kv_cached.labels(r.route).inc(r.cached_tokens or 0)

    def count_error(self, status: int, code: str) -> None:
        self.errors.labels(str(status), code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
