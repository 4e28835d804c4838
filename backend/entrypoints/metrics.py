"""Prometheus metrics of the backend server, in a registry of its own.

Counters and gauges are read from the engine's stats at scrape time, so they can never drift
from the engine's own numbers. Latency histograms are observed when a request finishes, from
the times the engine recorded for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from cachegw.backend.core.outputs import EngineStats, RequestOutput

PREFIX = "cachegw:"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)

# (name without the _total that prometheus-client appends, help, EngineStats field)
_COUNTERS = (
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("num_preemptions", "Sequences preempted for lack of KV blocks.", "num_preemptions"),
    ("prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).", "prompt_tokens"),
    ("generation_tokens", "Tokens generated.", "generation_tokens"),
    ("spec_decode_draft_tokens", "Draft tokens verified (speculative decoding).", "spec_decode_draft_tokens"),
    (
        "spec_decode_accepted_tokens",
        "Draft tokens accepted (speculative decoding).",
        "spec_decode_accepted_tokens",
    ),
    (
        "compiled_decode_steps",
        "Decode steps run by the compiled decode step ([engine] compile; 0 while it compiles).",
        "compiled_decode_steps",
    ),
)
_GAUGES = (
    ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", "kv_cache_usage"),
    ("num_requests_running", "Requests being computed.", "num_running"),
    ("num_requests_waiting", "Requests queued for a slot.", "num_waiting"),
)


class EngineStatsCollector(Collector):
    """Counters and gauges straight from ``EngineStats`` at every scrape."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for name, doc, field in _COUNTERS:
            yield CounterMetricFamily(PREFIX + name, doc, value=getattr(s, field))
        for name, doc, field in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=getattr(s, field))
        yield from _tier_metrics(s)
        yield _pinned(s)
        yield _swaps(s)

    def describe(self) -> Iterator[Metric]:
        # Lets the registry check names at registration without reading the engine.
        for name, doc, _ in _COUNTERS:
            yield CounterMetricFamily(PREFIX + name, doc)
        for name, doc, _ in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc)
        yield from _tier_metrics(None)
        yield _pinned(None)
        yield _swaps(None)


def _pinned(s: EngineStats | None) -> Metric:
    """Blocks held by pins (cache_pins, prompt_cache_retention): in the pool, or recorded in the tier."""
    doc = "KV blocks held by pinned prompt prefixes, by where they are kept (pool, tier)."
    family = GaugeMetricFamily(PREFIX + "kv_pinned_blocks", doc, labels=["where"])
    for where, n in (s.pinned_blocks if s is not None else {}).items():
        family.add_metric([where], n)
    return family


def _swaps(s: EngineStats | None) -> Metric:
    """Preempted sequences by what happened to their K/V ([engine] preemption_mode swap/auto)."""
    doc = "Preempted sequences swapped out to host memory, back in, or recomputed for lack of swap space."
    family = CounterMetricFamily(PREFIX + "kv_swaps", doc, labels=["direction"])
    if s is not None:
        for direction, n in (
            ("out", s.swap.swapped_out),
            ("in", s.swap.swapped_in),
            ("fallback", s.swap.fallbacks),
        ):
            family.add_metric([direction], n)
    return family


_HITS_DOC = "Prompt tokens found in the prefix cache, by the tier they came from (pool, ram, disk, redis)."
_LOAD_DOC = "Time to load one KV block from the ram, disk or redis tier into the pool."
_ERRORS_DOC = "Failed operations of a KV store (a disk write; Redis unreachable or slow): each a miss."


def _tier_metrics(s: EngineStats | None) -> Iterator[Metric]:
    """Prefix-cache hits, blocks and bytes per KV tier and the tiers' load latency (``s`` None: the
    families alone, for ``describe``)."""
    hits = CounterMetricFamily(PREFIX + "prefix_cache_hits", _HITS_DOC, labels=["tier"])
    blocks = GaugeMetricFamily(PREFIX + "kv_tier_blocks", "Findable KV blocks per tier.", labels=["tier"])
    size = GaugeMetricFamily(PREFIX + "kv_tier_bytes", "Bytes of KV blocks held per tier.", labels=["tier"])
    load = HistogramMetricFamily(PREFIX + "kv_tier_load_seconds", _LOAD_DOC, labels=["tier"])
    errors = CounterMetricFamily(PREFIX + "kv_tier_errors", _ERRORS_DOC, labels=["tier"])
    if s is not None:
        for tier, tokens in s.prefix_cache_hits_by_tier.items():
            hits.add_metric([tier], tokens)
        for tier, n in s.kv_tier.blocks.items():
            blocks.add_metric([tier], n)
            size.add_metric([tier], s.kv_tier.bytes[tier])
        for tier, buckets in s.kv_tier.load_seconds.items():
            load.add_metric([tier], buckets, s.kv_tier.load_seconds_sum[tier])
        for tier, n in s.kv_tier.errors.items():
            errors.add_metric([tier], n)
    yield from (hits, blocks, size, load, errors)


class ServerMetrics:
    """Everything ``GET /metrics`` exposes. Create one per server: it owns its registry."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(stats))
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival to the first generated token.",
            buckets=_TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds", "Mean time between generated tokens of a request.",
            buckets=_TPOT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
            buckets=_E2E_BUCKETS, registry=self.registry,
        )  # fmt: skip

    def observe_finished(self, out: RequestOutput) -> None:
        """Record a finished request's latencies (engine thread; histograms are thread-safe)."""
        m = out.metrics
        if m is None or m.finish_time is None:
            return
        self.e2e.observe(max(0.0, m.finish_time - m.arrival_time))
        if m.first_token_time is None:
            return
        self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        n = len(out.outputs[0].token_ids) if out.outputs else 0
        if n > 1:
            self.tpot.observe(max(0.0, m.finish_time - m.first_token_time) / (n - 1))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
