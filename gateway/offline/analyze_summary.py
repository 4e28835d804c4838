"""The numbers of a `cachegw analyze` report from a request log: totals by model, tenant and backend, hit
ratio over time, similarity and threshold sweep, repeated queries and scopes, the backend's prefix cache
per system prompt, what each canonicalization rule gained (most of it computed by ``gateway.storage.stats``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cachegw.gateway.storage import stats
from cachegw.gateway.storage.request_log import RequestLog, Row
from cachegw.gateway.storage.request_record import HITS, NOT_HITS

if TYPE_CHECKING:
    from cachegw.gateway.config import Settings

TOP_N = 15


def build_summary(log: RequestLog, settings: Settings) -> dict[str, Any]:
    """Every number the report shows, computed by gateway.storage.stats where it has the function."""
    from cachegw.gateway.request.tenants import Tenants

    rows, pricing = log.rows, settings.pricing
    flagged = sorted(log.flagged)
    t0 = log.since if log.since is not None else rows[0].ts
    t1 = log.until if log.until is not None else rows[-1].ts + 1e-3
    bucket = stats.auto_bucket(t1 - t0)
    current, seen = current_threshold(rows, settings.cache.threshold)
    by_tenant, name_of = stats.group(rows, "tenant"), Tenants(settings.tenants).name_of
    overall = stats.summarize(rows, pricing)
    curve = stats.threshold_sweep(rows, flagged, [*stats.SWEEP, current])  # one pass for both
    return {
        "meta": {"source": log.source, "since": t0, "until": t1, "generated_at": time.time()},
        "overall": {**overall, "flagged": len(flagged)},
        "by_model": _sorted({m: stats.summarize(g, pricing) for m, g in stats.group(rows, "model").items()}),
        "by_tenant": _sorted({name_of(t): stats.summarize(g, pricing) for t, g in by_tenant.items()}),
        "by_backend": _sorted(stats.by_backend(rows, pricing)),
        "timeseries": {"bucket_s": bucket, "points": stats.timeseries(rows, t0, t1, bucket)},
        "similarity": {**stats.similarity_histogram(rows), "threshold": current, "thresholds_seen": seen},
        "threshold_sweep": {"current": curve[-1], "curve": curve[:-1]},
        "top_queries": top_repeated(rows, "query_hash"),
        "top_scopes": top_repeated(rows, "scope"),
        "reasons": stats.reasons(rows),
        "prefix_cache_by_system": prefix_cache_by_system(rows, settings),
        "rules": rule_gains(rows, overall, settings),
    }


def _sorted(groups: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return dict(sorted(groups.items(), key=lambda kv: (-kv[1]["requests"], kv[0])))


def current_threshold(rows: Sequence[Row], configured: float) -> tuple[float, list[float]]:
    """The threshold most semantic lookups ran at (the log records it), else the configured one."""
    seen = Counter(float(r.threshold) for r in stats.semantic_rows(rows) if r.threshold is not None)
    return (seen.most_common(1)[0][0] if seen else configured), sorted(seen)


def top_repeated(rows: Sequence[Row], key: str, n: int = TOP_N) -> list[dict[str, Any]]:
    """The most repeated values of ``key`` (asked twice or more), with how many of them were hits."""
    groups = stats.group((r for r in rows if getattr(r, key)), key)
    out = []
    for value, count in stats.top(rows, key, n):
        if count < 2:
            break
        g = groups[value]
        text = next((r.query for r in g if r.query), None)
        hits = sum(1 for r in g if r.cache_result in HITS)
        out.append({key: value, "query": text, "requests": count, "hits": hits})
    return out


def _backend_rows(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r.cache_result in NOT_HITS]


def prefix_cache_by_system(rows: Sequence[Row], settings: Settings, n: int = TOP_N) -> list[dict[str, Any]]:
    """Backend prefix-cache ratio per system-prompt hash, over requests the backend answered."""
    out = []
    for h, g in stats.group(_backend_rows(rows), "system_hash").items():
        s = stats.summarize(g, settings.pricing)
        out.append(
            {
                "system_hash": h or "(none)",
                "requests": len(g),
                "prompt_tokens": s["prompt_tokens"],
                "cached_tokens": s["cached_tokens"],
                "prefix_cache_ratio": s["prefix_cache_ratio"],
            }
        )
    return sorted(out, key=lambda x: (-x["prompt_tokens"], x["system_hash"]))[:n]


def rule_gains(rows: Sequence[Row], overall: dict[str, Any], settings: Settings) -> list[dict[str, Any]]:
    """Per canonicalization rule: the requests where it fired against the rest (a correlation only).

    One ``summarize`` per rule, over the rows it fired on; the rest is the overall totals minus those."""
    fired = [set(filter(None, (r.rules_fired or "").split(","))) for r in rows]
    counts = Counter(rule for rules in fired for rule in rules)
    total = _totals(overall)
    out = []
    for rule, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        on = _totals(
            stats.summarize([r for r, f in zip(rows, fired, strict=True) if rule in f], settings.pricing)
        )
        sides = _side(*on), _side(*(t - o for t, o in zip(total, on, strict=True)))
        gain = None
        if sides[0]["prefix_cache_ratio"] is not None and sides[1]["prefix_cache_ratio"] is not None:
            gain = round(sides[0]["prefix_cache_ratio"] - sides[1]["prefix_cache_ratio"], 4)
        out.append({"rule": rule, "fired": sides[0], "not_fired": sides[1], "prefix_cache_gain": gain})
    return out


def _totals(s: dict[str, Any]) -> tuple[int, int, int, int]:
    return s["requests"], s["exact_hits"] + s["semantic_hits"], s["prompt_tokens"], s["cached_tokens"]


def _side(n: int, hits: int, prompt: int, cached: int) -> dict[str, Any]:
    """One side of a rule: requests, hits, backend tokens, and their ratios rounded as stats rounds them."""
    return {
        "requests": n,
        "hits": hits,
        "hit_ratio": round(hits / n, 4) if n else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefix_cache_ratio": round(cached / prompt, 4) if prompt else None,
    }
