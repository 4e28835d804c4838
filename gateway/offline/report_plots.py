"""The PNG charts of a `cachegw analyze` report (its tables: ``gateway/offline/report_tables.py``, its page:
``gateway/offline/report_page.py``).

Everything in the report reads the summary dict (summary.json) alone, so every number on the page or in a
chart is in the summary, and a kept summary can be redrawn. matplotlib is imported only to draw (Figure
objects, no pyplot state, Agg canvas: no display needed).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachegw.gateway.offline.report_tables import Summary, duration, pct, usd

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

ProgressFactory = Callable[[str, float], AbstractContextManager[Callable[[float], None]]]
RESULTS = (("exact_hits", "exact hit", "#2a7"), ("semantic_hits", "semantic hit", "#9c5"))
RESULTS += (("misses", "miss", "#d77"), ("bypasses", "bypass", "#bbb"))
DPI = 90


# Page


# Charts


def draw_charts(s: Summary, out: Path, progress: ProgressFactory) -> list[str]:
    """Every chart as a PNG in ``out``; returns the file names."""
    from matplotlib.figure import Figure

    names = []
    with progress("drawing charts", len(CHARTS)) as advance:
        for name, (size, draw) in CHARTS.items():
            fig = Figure(figsize=size, dpi=DPI, layout="constrained")
            draw(fig, s)
            fig.savefig(out / name)
            names.append(name)
            advance(1)
    return names


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666")
    ax.set_xticks([])
    ax.set_yticks([])


def _hit_ratio_over_time(fig: Figure, s: Summary) -> None:
    import matplotlib.dates as mdates

    ax = fig.subplots()
    pts, bucket = s["timeseries"]["points"], s["timeseries"]["bucket_s"]
    x = [datetime.fromtimestamp(p["t"] + bucket / 2, UTC) for p in pts]
    bottom = [0] * len(pts)
    for key, label, color in RESULTS:
        h = [p[key] for p in pts]
        ax.bar(x, h, width=bucket / 86400 * 0.9, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, h, strict=True)]
    ax.set_ylabel(f"requests per {duration(bucket)}")
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(ax.xaxis.get_major_locator()))
    ax.set_xlabel("time (UTC)")
    right = ax.twinx()
    for key, label, style in (
        ("hit_ratio", "hit ratio", "k-"),
        ("prefix_cache_ratio", "prefix-cache ratio", "b--"),
    ):
        right.plot(
            x, [p[key] if p[key] is not None else float("nan") for p in pts], style, label=label, lw=1.5
        )
    right.set_ylim(0, 1.02)
    right.set_ylabel("ratio")
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    fig.legend(handles=handles, loc="outside lower center", fontsize=8, ncols=6)
    ax.set_title(f"Hit ratio over time (overall {pct(s['overall']['hit_ratio'])})")


def _similarity(fig: Figure, s: Summary) -> None:
    ax = fig.subplots()
    sim = s["similarity"]
    edges, hits, misses = sim["edges"], sim["hits"], sim["misses"]
    if not sum(hits) + sum(misses):
        return _empty(ax, "no semantic lookups in this range")
    ax.stairs(misses, edges, fill=True, alpha=0.55, color="#d77", label=f"misses ({sum(misses):,})")
    ax.stairs(hits, edges, fill=True, alpha=0.55, color="#2a7", label=f"semantic hits ({sum(hits):,})")
    for t in sim["thresholds_seen"] or [sim["threshold"]]:
        ls = "-" if t == sim["threshold"] else ":"
        ax.axvline(t, color="k", ls=ls, lw=1.2, label=f"threshold {t:.2f}")
    first = next(i for i, (h, m) in enumerate(zip(hits, misses, strict=True)) if h or m)
    ax.set_xlim(max(0.0, edges[first] - 0.02), 1.0)
    ax.set_xlabel("nearest-neighbour cosine similarity")
    ax.set_ylabel("requests")
    ax.legend(fontsize=8)
    ax.set_title("Similarity of the nearest cached query: hits vs misses")


def _counts_bars(ax: Axes, groups: dict[str, dict[str, Any]], title: str) -> None:
    names = list(groups)[:10][::-1]
    left = [0] * len(names)
    for key, label, color in RESULTS:
        w = [groups[n][key] for n in names]
        ax.barh([_label(n) for n in names], w, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, w, strict=True)]
    ax.set_title(title)
    ax.set_xlabel("requests")


def _label(text: str, n: int = 22) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _hits_by_model_tenant(fig: Figure, s: Summary) -> None:
    a, b = fig.subplots(1, 2)
    _counts_bars(a, s["by_model"], "By model")
    _counts_bars(b, s["by_tenant"], "By tenant (top 10)")
    a.legend(fontsize=8, loc="lower right")


def _prefix_cache_by_system(fig: Figure, s: Summary) -> None:
    ax = fig.subplots()
    rows = [r for r in s["prefix_cache_by_system"] if r["prefix_cache_ratio"] is not None][::-1]
    if not rows:
        return _empty(ax, "no backend token counts in this range")
    ax.barh([r["system_hash"] for r in rows], [r["prefix_cache_ratio"] for r in rows], color="#58b")
    for i, r in enumerate(rows):
        ax.text(r["prefix_cache_ratio"] + 0.01, i, f"{r['requests']:,} req, {r['prompt_tokens']:,} tok",
                va="center", fontsize=7)  # fmt: skip
    ax.set_xlim(0, 1.25)
    ax.set_xlabel("cached prompt tokens / prompt tokens (misses and bypasses)")
    ax.set_title("Backend prefix-cache ratio by system-prompt hash")


def _rules(fig: Figure, s: Summary) -> None:
    ax = fig.subplots()
    rules = s["rules"][::-1]
    if not rules:
        return _empty(ax, "no canonicalization rule fired in this range")
    y = range(len(rules))
    val = lambda side: [r[side]["prefix_cache_ratio"] or 0.0 for r in rules]
    ax.barh([i + 0.2 for i in y], val("fired"), 0.4, color="#58b", label="rule fired")
    ax.barh([i - 0.2 for i in y], val("not_fired"), 0.4, color="#bbb", label="rule did not fire")
    ax.set_yticks(list(y), [f"{r['rule']} ({r['fired']['requests']:,})" for r in rules])
    ax.set_xlim(0, 1)
    ax.set_xlabel("backend prefix-cache ratio (correlation, not causation)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Canonicalization rules: prefix-cache ratio where each fired vs not")


def _latency_cost(fig: Figure, s: Summary) -> None:
    a, b = fig.subplots(1, 2)
    lat = s["overall"]["latency_ms"]
    names = [k for k, v in lat.items() if v["n"]]
    if names:
        x = range(len(names))
        a.bar([i - 0.2 for i in x], [lat[k]["p50"] for k in names], 0.4, color="#58b", label="p50")
        a.bar([i + 0.2 for i in x], [lat[k]["p99"] for k in names], 0.4, color="#235", label="p99")
        a.set_xticks(list(x), names)
        a.set_yscale("log")
        a.set_ylabel("ms (log)")
        a.legend(fontsize=8)
    else:
        _empty(a, "no latencies recorded")
    a.set_title("Request latency")
    models = list(s["by_model"])[:8]
    b.bar([_label(m, 14) for m in models], [s["by_model"][m]["cost_saved_usd"] for m in models], color="#2a7")
    b.set_ylabel("USD (estimate)")
    b.tick_params(axis="x", labelrotation=20, labelsize=8)
    b.set_title(f"Cost saved by model (total {usd(s['overall']['cost_saved_usd'])})")


def _threshold_sweep(fig: Figure, s: Summary) -> None:
    ax = fig.subplots()
    curve, cur = s["threshold_sweep"]["curve"], s["threshold_sweep"]["current"]
    if not sum(s["similarity"]["hits"]) + sum(s["similarity"]["misses"]):
        return _empty(ax, "no semantic lookups in this range: nothing to replay")
    t = [p["threshold"] for p in curve]
    ax.plot(t, [p["candidates"] for p in curve], "-", color="#2a7", label="candidates")
    ax.plot(t, [p["new_candidates"] for p in curve], "--", color="#9c5", label="of which recorded misses")
    ax.plot(t, [p["estimated_false"] for p in curve], "-", color="#c33", label="estimated false hits")
    ax.axvline(cur["threshold"], color="k", lw=1, ls=":", label=f"current {cur['threshold']:.2f}")
    ax.set_xlabel("threshold")
    ax.set_ylabel("requests")
    ax.legend(fontsize=8)
    ax.set_title("Threshold sweep over the recorded nearest-neighbour similarities")


CHARTS: dict[str, tuple[tuple[float, float], Callable[[Figure, Summary], None]]] = {
    "hit_ratio_over_time.png": ((9, 4.2), _hit_ratio_over_time),
    "similarity.png": ((8, 3.6), _similarity),
    "hits_by_model_tenant.png": ((10, 3.6), _hits_by_model_tenant),
    "prefix_cache_by_system.png": ((8, 3.8), _prefix_cache_by_system),
    "rules.png": ((8, 3.8), _rules),
    "latency_cost.png": ((10, 3.6), _latency_cost),
    "threshold_sweep.png": ((8, 3.6), _threshold_sweep),
}
