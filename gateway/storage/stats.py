"""Hit-rate statistics over request-log rows: one implementation for the admin API, the dashboard
and `cachegw analyze`.

Rows are ``RequestRecord``s (from the database or a JSONL export), read by attribute, so the
numbers a report prints are the numbers the dashboard shows.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from cachegw.gateway.config import PricingConfig
from cachegw.gateway.storage.request_record import HITS, NOT_HITS, CacheResult, RequestRecord

_WINDOW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
Row = RequestRecord
SWEEP = tuple(round(0.5 + 0.01 * i, 2) for i in range(51))  # thresholds of what-if curves and reports


def parse_window(text: str) -> float:
    """'90s', '15m', '1h', '7d', '2w' -> seconds."""
    m = _WINDOW.match(text or "")
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"window must look like 15m, 1h, 7d (got {text!r})")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def _pct(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if len(values) else None


def _num(value: float | None) -> float:
    return float(value) if value is not None else 0.0


def saved_usd(row: Row, pricing: PricingConfig) -> float:
    """What a request saved: a hit the whole backend call, a miss its prefix-cached prompt tokens."""
    input_price, output_price = pricing.price(row.model or "")
    if row.cache_result in HITS:
        cost = _num(row.prompt_tokens) * input_price + _num(row.completion_tokens) * output_price
        return cost / 1e6
    return _num(row.cached_tokens) * input_price * pricing.cached_input_discount / 1e6


def summarize(rows: Sequence[Row], pricing: PricingConfig) -> dict[str, Any]:
    """Counts, ratios, latency percentiles, tokens and money saved."""
    counts = Counter(r.cache_result for r in rows)
    n = len(rows)
    hits = counts[CacheResult.EXACT_HIT] + counts[CacheResult.SEMANTIC_HIT]
    backend = [r for r in rows if r.cache_result in NOT_HITS and r.prompt_tokens]
    prompt = sum(_num(r.prompt_tokens) for r in backend)
    cached = sum(_num(r.cached_tokens) for r in backend)
    latency: dict[str, dict[str, float | None]] = {}
    for name, results in (("hit", HITS), ("miss", {CacheResult.MISS}), ("bypass", {CacheResult.BYPASS})):
        ms = [float(r.total_ms) for r in rows if r.cache_result in results and r.total_ms is not None]
        latency[name] = {"p50": _pct(ms, 50), "p99": _pct(ms, 99), "n": len(ms)}
    hit_rows = [r for r in rows if r.cache_result in HITS]
    return {
        "requests": n,
        "exact_hits": counts[CacheResult.EXACT_HIT],
        "semantic_hits": counts[CacheResult.SEMANTIC_HIT],
        "misses": counts[CacheResult.MISS],
        "bypasses": counts[CacheResult.BYPASS],
        "errors": sum(1 for r in rows if (r.status or 200) >= 400),
        "hit_ratio": round(hits / n, 4) if n else 0.0,
        "prompt_tokens": int(prompt),
        "cached_tokens": int(cached),
        "prefix_cache_ratio": round(cached / prompt, 4) if prompt else None,
        "tokens_saved": int(sum(_num(r.prompt_tokens) + _num(r.completion_tokens) for r in hit_rows)),
        "cost_saved_usd": round(sum(saved_usd(r, pricing) for r in rows), 6),
        "latency_ms": latency,
    }


def group(rows: Iterable[Row], key: str) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        out[str(getattr(r, key) or "")].append(r)
    return dict(out)


def by_backend(rows: Iterable[Row], pricing: PricingConfig) -> dict[str, dict[str, Any]]:
    """Requests each backend answered (misses and bypasses; hits never reach one), with its prefix-cache
    ratio: how well the routing keeps conversations where their KV blocks are."""
    answered = group((r for r in rows if r.backend), "backend")
    out = {}
    for b, g in answered.items():
        ms = [float(r.total_ms) for r in g if r.total_ms is not None]
        # whole-request latency of everything this backend answered, misses and bypasses together
        out[b] = {
            **summarize(g, pricing),
            "answered_ms": {"p50": _pct(ms, 50), "p99": _pct(ms, 99), "n": len(ms)},
        }
    return out


def timeseries(rows: Sequence[Row], since: float, until: float, bucket_s: float) -> list[dict[str, Any]]:
    """Counts and ratios per time bucket, empty buckets included (a chart needs the gaps)."""
    n_buckets = max(1, math.ceil((until - since) / bucket_s))
    buckets: list[list[Row]] = [[] for _ in range(n_buckets)]
    for r in rows:
        i = int((float(r.ts) - since) // bucket_s)
        if 0 <= i < n_buckets:
            buckets[i].append(r)
    points = []
    for i, b in enumerate(buckets):
        c = Counter(r.cache_result for r in b)
        prompt = sum(_num(r.prompt_tokens) for r in b if r.cache_result in NOT_HITS)
        cached = sum(_num(r.cached_tokens) for r in b if r.cache_result in NOT_HITS)
        points.append(
            {
                "t": since + i * bucket_s,
                "requests": len(b),
                "exact_hits": c[CacheResult.EXACT_HIT],
                "semantic_hits": c[CacheResult.SEMANTIC_HIT],
                "misses": c[CacheResult.MISS],
                "bypasses": c[CacheResult.BYPASS],
                "hit_ratio": round(sum(c[h] for h in HITS) / len(b), 4) if b else None,
                "prefix_cache_ratio": round(cached / prompt, 4) if prompt else None,
                # "miss:below-threshold" -> count: the dashboard's reasons-over-time table
                "reasons": dict(Counter(_reason_key(r) for r in b if r.cache_result in NOT_HITS)),
            }
        )
    return points


def _reason_key(row: Row) -> str:
    return f"{row.cache_result}:{row.reason or 'unrecorded'}"


def reasons(rows: Iterable[Row]) -> list[dict[str, Any]]:
    """Why requests were not hits: (result, x-cache-reason) counted, most frequent first."""
    counts = Counter(_reason_key(r) for r in rows if r.cache_result in NOT_HITS)
    total = sum(counts.values())
    return [
        {"result": key.split(":", 1)[0], "reason": key.split(":", 1)[1], "requests": n, "share": n / total}
        for key, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    ]


def auto_bucket(window_s: float) -> float:
    """About 60 points per chart, on round bucket sizes."""
    for b in (10, 30, 60, 300, 600, 1800, 3600, 3 * 3600, 6 * 3600, 86400):
        if window_s / b <= 90:
            return b
    return 86400


def semantic_rows(rows: Iterable[Row]) -> list[Row]:
    """Requests that went through the semantic search and saw a nearest neighbour."""
    return [
        r
        for r in rows
        if r.cache_result in (CacheResult.SEMANTIC_HIT, CacheResult.MISS) and r.similarity is not None
    ]


def similarity_histogram(rows: Sequence[Row], bins: int = 50, low: float = 0.0) -> dict[str, Any]:
    """Nearest-neighbour similarity of semantic hits and of misses, on shared bin edges."""
    edges = np.linspace(low, 1.0, bins + 1)
    sem = semantic_rows(rows)
    hit = [_num(r.similarity) for r in sem if r.cache_result == CacheResult.SEMANTIC_HIT]
    miss = [_num(r.similarity) for r in sem if r.cache_result == CacheResult.MISS]
    return {
        "edges": [round(float(e), 4) for e in edges],
        "hits": np.histogram(np.clip(hit, low, 1.0), edges)[0].tolist(),
        "misses": np.histogram(np.clip(miss, low, 1.0), edges)[0].tolist(),
    }


def threshold_sweep(
    rows: Sequence[Row], flagged_request_ids: Iterable[str], thresholds: Sequence[float]
) -> list[dict[str, Any]]:
    """Replay the recorded nearest-neighbour similarities at other thresholds.

    ``candidates``: semantic lookups whose nearest neighbour clears t (an upper bound on semantic
    hits: the verifier still checks each). ``known_false``: of those, semantic hits flagged bad
    (a flagged exact hit is a wrong stored answer, not a threshold question). ``estimated_false``:
    known ones plus the new candidates times the flag rate seen on served semantic hits.
    """
    sem = semantic_rows(rows)
    flagged = set(flagged_request_ids)
    sims = np.array([_num(r.similarity) for r in sem])
    is_miss = np.array([r.cache_result == CacheResult.MISS for r in sem], dtype=bool)
    is_flag = np.array([r.id in flagged for r in sem], dtype=bool) & ~is_miss
    served = int((~is_miss).sum())
    flag_rate = float(is_flag.sum()) / served if served else 0.0
    order = np.argsort(-sims, kind="stable")  # descending: rows above t are a prefix
    sims_desc = sims[order]
    new_cum = np.concatenate([[0], np.cumsum(is_miss[order])])
    flag_cum = np.concatenate([[0], np.cumsum(is_flag[order])])
    total = len(rows)
    exact = sum(1 for r in rows if r.cache_result == CacheResult.EXACT_HIT)
    out = []
    for t in thresholds:
        n_above = int(np.searchsorted(-sims_desc, -float(t), side="right"))
        new, known = int(new_cum[n_above]), int(flag_cum[n_above])
        out.append(
            {
                "threshold": round(float(t), 4),
                "candidates": n_above,
                "new_candidates": new,
                "known_false": known,
                "estimated_false": round(known + new * flag_rate, 2),
                "hit_ratio_upper": round((n_above + exact) / total, 4) if total else 0.0,
            }
        )
    return out


def top(rows: Iterable[Row], key: str, n: int = 10) -> list[tuple[str, int]]:
    return Counter(str(getattr(r, key)) for r in rows if getattr(r, key)).most_common(n)
