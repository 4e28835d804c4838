"""config.toml [cache] and its sub-tables, one per concern: the policy ([cache]), the query encoder
([cache.encoder]), the pair verifier ([cache.verifier]), the false-hit bound ([cache.error_bound]) and
the audits that feed it ([cache.audits])."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator

from cachegw.configtools import Strict
from cachegw.policies.bound_prior import PriorWeight
from cachegw.policies.evidence_window import Ageing

Threshold = float

# [cache] keys by the flat names they had before the sub-tables, each with its place now. The run-time
# settings keep their stored overrides under these names (gateway/live_settings.py).
FLAT: dict[str, tuple[str, str]] = {
    "verifier": ("verifier", "enabled"),
    "verifier_threshold": ("verifier", "threshold"),
    "verifier_path": ("verifier", "path"),
    "cross_verifier": ("verifier", "cross_verifier"),
    "cross_verifier_path": ("verifier", "cross_verifier_path"),
    "embed_backend": ("encoder", "backend"),
    "embed_threads": ("encoder", "threads"),
    "embed_batch_window_ms": ("encoder", "batch_window_ms"),
    "embed_max_batch": ("encoder", "max_batch"),
    **{
        k: ("error_bound", k)
        for k in (
            "max_false_hit_rate",
            "max_false_hit_rate_by_model",
            "max_false_hit_rate_by_tenant",
            "false_hit_confidence",
            "evidence_max_age_s",
            "evidence_max_audits",
            "false_hit_prior",
            "false_hit_prior_strength",
            "false_hit_prior_fade",
        )
    },
    **{
        f"audit_{k}": ("audits", k)
        for k in ("fraction", "max_per_second", "answer_cosine", "priority", "send_priority")
    },
}
# The same keys as a user's config.toml may still name them: loading it fails naming the new place.
MOVED: dict[str, str] = {f"cache.{flat}": f"[cache.{sub}] {field}" for flat, (sub, field) in FLAT.items()}


def _in_range(values: dict[str, float], lo: float, hi: float, hi_open: bool, what: str) -> dict[str, float]:
    bad = {k: v for k, v in values.items() if not (lo <= v < hi if hi_open else lo <= v <= hi)}
    if bad:
        raise ValueError(f"{what} must be in [{lo:g}, {hi:g}{')' if hi_open else ']'}: {bad}")
    return values


class EncoderConfig(Strict):
    """[cache.encoder]: the query encoder of the gateway process (same vectors whichever runs)."""

    backend: Literal["auto", "onnx", "torch"] = Field(
        description="auto (ONNX Runtime when it loads, else torch) | onnx | torch"
    )
    threads: int = Field(gt=0, description="torch and ONNX Runtime threads of the gateway process")
    batch_window_ms: float = Field(
        ge=0,
        description="0: an idle encoder starts at once; lookups arriving while it works share the next batch",
    )
    max_batch: int = Field(gt=0, description="queries encoded in one batch at most")
    int8: bool = Field(
        description="ONNX Runtime with int8 weights: 2.4x less time per query, each query run alone"
    )


class VerifierConfig(Strict):
    """[cache.verifier]: the learned pair verifier a semantic hit must pass."""

    enabled: bool = Field(description="the learned pair verifier must agree (policies/verifier.py)")
    threshold: float = Field(ge=0, le=1, description="its final probability a hit needs at least")
    path: str = Field(
        description='"" = the shipped policies/artifacts/verifier.npz; or one from `cachegw train-verifier`'
    )
    cross_verifier: bool = Field(description="second stage: MiniLM reads both queries together (int8 ONNX)")
    cross_verifier_path: str = Field(description='"" = the shipped embeddings/artifacts/cross_encoder.npz')
    skip_cross_from: float = Field(
        ge=0,
        description="a pair whose MLP probability reaches this is accepted without the cross-encoder "
        "(fixed threshold only; 2 = always asked)",
    )


class ErrorBoundConfig(Strict):
    """[cache.error_bound]: a bounded false-hit rate per model and tenant (docs/verifier.md)."""

    max_false_hit_rate: float = Field(
        ge=0, lt=1, description="e.g. 0.02; 0 = off: the static thresholds decide"
    )
    max_false_hit_rate_by_model: dict[str, float] = Field(
        description="model = rate (0 = static for that model)"
    )
    max_false_hit_rate_by_tenant: dict[str, float] = Field(description="tenant = rate; the tenant's wins")
    false_hit_confidence: float = Field(gt=0, lt=1, description="of the one-sided Clopper-Pearson bound")
    evidence_max_age_s: float = Field(
        ge=0, description="older audits, reports and seeds are dropped; 0 = no limit"
    )
    evidence_max_audits: int = Field(
        ge=0, description="the newest N of each scope (and entry) count; 0 = no limit"
    )
    false_hit_prior: str = Field(
        min_length=1,
        description='"shipped" = policies/artifacts/bound_prior.json; "none" = live evidence only; or a '
        "file from `cachegw calibrate --write-prior`",
    )
    false_hit_prior_strength: float = Field(
        ge=0, description="the prior counts as this many audits at most (0 = off)"
    )
    false_hit_prior_fade: int = Field(
        gt=0, description="live audits of a scope after which the prior no longer counts (falls linearly)"
    )

    @field_validator("max_false_hit_rate_by_model", "max_false_hit_rate_by_tenant")
    @classmethod
    def _rates(cls, values: dict[str, float]) -> dict[str, float]:
        return _in_range(values, 0, 1, True, "false-hit rates")

    @property
    def ageing(self) -> Ageing:
        return Ageing(self.evidence_max_age_s, self.evidence_max_audits)

    @property
    def prior_weight(self) -> PriorWeight:
        off = self.false_hit_prior == "none"
        return PriorWeight(0.0 if off else self.false_hit_prior_strength, self.false_hit_prior_fade)

    def false_hit_target(self, model: str, tenant_name: str) -> float:
        """The false-hit rate the scope must stay under (0 = static thresholds): per-tenant over
        per-model over the global one, as the thresholds."""
        by_model = self.max_false_hit_rate_by_model.get(model, self.max_false_hit_rate)
        return self.max_false_hit_rate_by_tenant.get(tenant_name, by_model)


class AuditsConfig(Strict):
    """[cache.audits]: semantic hits and near misses re-asked to the backend, the bound's evidence."""

    fraction: float = Field(ge=0, le=1, description="share of semantic hits and of near misses audited")
    max_per_second: float = Field(ge=0, description="audit budget (token bucket); audits over it are dropped")
    answer_cosine: float = Field(
        ge=0, le=1, description="different answers count as the same this close; 1.0 = identical answers only"
    )
    priority: int = Field(
        ge=-1000, le=1000, description="vLLM's `priority` of the re-asks: lower is scheduled first"
    )
    send_priority: Literal["auto", "always", "never"] = Field(
        description="auto: priority sent to the built-in engine only | always | never"
    )
    keep_days: float = Field(
        ge=0,
        description="hit_audits rows older than this and than evidence_max_age_s are deleted; 0 = kept",
    )


class CacheConfig(Strict):
    """[cache]: what is cached and served, and for how long."""

    enabled: bool = Field(description="the response cache at all")
    exact: bool = Field(description="identical requests answered without embedding")
    semantic: bool = Field(description="paraphrases answered after embedding + verifier")
    threshold: float = Field(ge=0, le=1, description="cosine similarity a semantic hit needs at least")
    thresholds_by_model: dict[str, Threshold] = Field(description="model = threshold")
    thresholds_by_tenant: dict[str, Threshold] = Field(description="tenant name (or key hash) = threshold")
    ttl_seconds: int = Field(
        gt=0, description="default life of an entry (x-cache-ttl overrides, up to the max)"
    )
    max_ttl_seconds: int = Field(gt=0, description="longest life an entry may be given")
    max_entries: int = Field(gt=0, description="entries kept at most")
    max_bytes: int = Field(gt=0, description="stored response bytes at most")
    eviction: Literal["lru", "lfu"] = Field(description="which entries go first: lru | lfu")
    serve_temperature_above_zero: bool = Field(description="serve cached answers to sampling requests")
    serve_unset_temperature: bool = Field(
        description="serve cached answers to requests that leave temperature unset"
    )
    serve_unset_temperature_by_model: dict[str, bool] = Field(description="model = true | false")
    serve_unset_temperature_by_tenant: dict[str, bool] = Field(
        description="tenant = true | false; the tenant's wins"
    )
    feedback_margin: float = Field(
        ge=0, le=1, description="a semantic hit flagged bad raises its entry's threshold to similarity + this"
    )
    near_miss_links: bool = Field(
        description="near misses (refused by the verifier or the error-bound line) compared with their "
        "fresh answer; equal answers link the two entries, and a request near both ends of a link is "
        "served (static thresholds only)"
    )
    sync_interval_s: float = Field(
        ge=0,
        description="replicas on one database: the fallback poll of the change log (PostgreSQL also "
        "notifies at once); 0 = off",
    )
    change_log_rows: int = Field(
        gt=0, description="change-log rows kept; a replica further behind reloads its views"
    )
    exact_keys_in_memory: int = Field(
        ge=0,
        description="exact keys each replica mirrors in memory, least recently used dropped (one not "
        "mirrored is one indexed query); 0 = all (read at start)",
    )
    model_memo_entries: int = Field(
        ge=0,
        description="query vectors and cross-encoder scores kept by their exact text, least recently used "
        "dropped: a repeated question runs no model; 0 = off (read at start)",
    )
    encoder: EncoderConfig = Field(description="the query encoder")
    verifier: VerifierConfig = Field(description="the pair verifier")
    error_bound: ErrorBoundConfig = Field(description="the bounded false-hit rate")
    audits: AuditsConfig = Field(description="the audits that feed it")

    @field_validator("thresholds_by_model", "thresholds_by_tenant")
    @classmethod
    def _in_unit_range(cls, values: dict[str, float]) -> dict[str, float]:
        return _in_range(values, 0, 1, False, "thresholds")

    def serves_unset_temperature(self, model: str, tenant_name: str) -> bool:
        """Whether a request leaving ``temperature`` unset may be served from (and stored into) the cache:
        per-tenant over per-model over the global switch, as the thresholds."""
        by_model = self.serve_unset_temperature_by_model.get(model, self.serve_unset_temperature)
        return self.serve_unset_temperature_by_tenant.get(tenant_name, by_model)

    def flat(self, name: str) -> Any:
        """A value by its [cache] name or its flat name (``FLAT``)."""
        sub, field = FLAT.get(name, ("", name))
        return getattr(getattr(self, sub) if sub else self, field)

    def updated(self, changes: Mapping[str, Any]) -> CacheConfig:
        """A copy with ``changes`` laid over it, by [cache] name or flat name (``FLAT``); unvalidated,
        as ``model_copy`` (callers validate their values)."""
        top: dict[str, Any] = {}
        subs: dict[str, dict[str, Any]] = {}
        for name, value in changes.items():
            if name in FLAT:
                sub, field = FLAT[name]
                subs.setdefault(sub, {})[field] = value
            else:
                top[name] = value
        for sub, fields in subs.items():
            top[sub] = getattr(self, sub).model_copy(update=fields)
        return self.model_copy(update=top)
