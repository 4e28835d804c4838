"""The report of `cachegw analyze`: its tables, its page (HTML or Markdown) and its PNG charts.

Everything here reads the summary dict (summary.json) alone, so every number on the page or in a chart is
in the summary, and a kept summary can be redrawn. matplotlib is imported only to draw (Figure objects,
no pyplot state, Agg canvas: no display needed).
"""

from __future__ import annotations

import html
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Summary = dict[str, Any]
ProgressFactory = Callable[[str, float], AbstractContextManager[Callable[[float], None]]]
RESULTS = (("exact_hits", "exact hit", "#2a7"), ("semantic_hits", "semantic hit", "#9c5"))
RESULTS += (("misses", "miss", "#d77"), ("bypasses", "bypass", "#bbb"))
TOP_N = 15
DPI = 90


@dataclass
class TableSpec:
    title: str
    headers: list[str]
    rows: list[list[str]]


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def usd(x: float) -> str:
    return f"${x:,.4f}" if x < 100 else f"${x:,.2f}"


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _short(text: str | None, n: int = 70) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= n else text[: n - 1] + "…"


def report_tables(s: dict[str, Any]) -> dict[str, TableSpec]:
    """The tables of the terminal and of the report page, from summary.json alone."""
    o = s["overall"]
    overall = [
        ["requests", f"{o['requests']:,}"],
        ["exact hits", f"{o['exact_hits']:,}"],
        ["semantic hits", f"{o['semantic_hits']:,}"],
        ["misses", f"{o['misses']:,}"],
        ["bypasses", f"{o['bypasses']:,}"],
        ["errors (status >= 400)", f"{o['errors']:,}"],
        ["hits flagged bad", f"{o['flagged']:,}"],
        ["hit ratio", pct(o["hit_ratio"])],
        ["backend prefix-cache ratio", pct(o["prefix_cache_ratio"])],
        ["tokens saved by hits", f"{o['tokens_saved']:,}"],
        ["cost saved (estimate)", usd(o["cost_saved_usd"])],
    ]
    heads = ["requests", "hit ratio", "exact", "semantic", "prefix cache", "saved"]

    def grouped(groups: dict[str, dict[str, Any]]) -> list[list[str]]:
        return [
            [_short(k, 34) or "(none)", f"{g['requests']:,}", pct(g["hit_ratio"]), f"{g['exact_hits']:,}"]
            + [f"{g['semantic_hits']:,}", pct(g["prefix_cache_ratio"]), usd(g["cost_saved_usd"])]
            for k, g in list(groups.items())[:TOP_N]
        ]

    lat = [
        [name, ms(v["p50"]), ms(v["p99"]), f"{v['n']:,}"] for name, v in s["overall"]["latency_ms"].items()
    ]
    return {
        "overall": TableSpec("Overall", ["", "value"], overall),
        "by_model": TableSpec("By model", ["model", *heads], grouped(s["by_model"])),
        "by_tenant": TableSpec("By tenant", ["tenant", *heads], grouped(s["by_tenant"])),
        "by_backend": TableSpec(
            "By backend (the requests each answered)",
            ["backend", "requests", "prefix cache", "p50 ms", "p99 ms"],
            [
                [_short(k, 34), f"{g['requests']:,}", pct(g["prefix_cache_ratio"])]
                + [ms(g.get("answered_ms", {}).get(q)) for q in ("p50", "p99")]
                for k, g in list(s.get("by_backend", {}).items())[:TOP_N]
            ],
        ),
        "sweep": TableSpec(
            "Threshold sweep (replayed near-misses)",
            ["threshold", "candidates", "new", "known false", "est. false", "hit ratio ≤"],
            [_sweep_row(p, s["similarity"]["threshold"]) for p in sweep_excerpt(s)],
        ),
        "top_queries": TableSpec(
            "Top repeated queries",
            ["query", "requests", "hits"],
            [
                [
                    _short(q["query"]) or f"(not logged) {q['query_hash']}",
                    f"{q['requests']:,}",
                    f"{q['hits']:,}",
                ]
                for q in s["top_queries"]
            ],
        ),
        "reasons": TableSpec(
            "Why requests were not hits (x-cache-reason)",
            ["result", "reason", "requests", "share"],
            [
                [r["result"], r["reason"], f"{r['requests']:,}", f"{r['share']:.1%}"]
                for r in s.get("reasons", [])
            ],
        ),
        "top_scopes": TableSpec(
            "Top scopes",
            ["scope", "requests", "hits"],
            [[q["scope"][:16], f"{q['requests']:,}", f"{q['hits']:,}"] for q in s["top_scopes"]],
        ),
        "prefix": TableSpec(
            "Prefix-cache ratio by system prompt (misses and bypasses)",
            ["system hash", "requests", "prompt tokens", "cached tokens", "ratio"],
            [
                [
                    p["system_hash"],
                    f"{p['requests']:,}",
                    f"{p['prompt_tokens']:,}",
                    f"{p['cached_tokens']:,}",
                    pct(p["prefix_cache_ratio"]),
                ]
                for p in s["prefix_cache_by_system"]
            ],
        ),
        "rules": TableSpec(
            "Canonicalization rules",
            ["rule", "fired on", "prefix cache (fired)", "prefix cache (not)", "hit ratio (fired)", "(not)"],
            [
                [
                    r["rule"],
                    f"{r['fired']['requests']:,}",
                    pct(r["fired"]["prefix_cache_ratio"]),
                    pct(r["not_fired"]["prefix_cache_ratio"]),
                    pct(r["fired"]["hit_ratio"]),
                    pct(r["not_fired"]["hit_ratio"]),
                ]
                for r in s["rules"]
            ],
        ),
        "latency": TableSpec("Latency (ms, whole request)", ["result", "p50", "p99", "requests"], lat),
    }


def sweep_excerpt(s: dict[str, Any]) -> list[dict[str, Any]]:
    """Every 0.02 within 0.1 of the current threshold, the current one included."""
    cur = s["threshold_sweep"]["current"]
    near = [p for p in s["threshold_sweep"]["curve"] if abs(p["threshold"] - cur["threshold"]) <= 0.1001]
    near = [p for p in near if round(abs(p["threshold"] - cur["threshold"]) * 100) % 2 == 0]
    return sorted({p["threshold"]: p for p in [*near, cur]}.values(), key=lambda p: p["threshold"])


def _sweep_row(p: dict[str, Any], current: float) -> list[str]:
    mark = " (current)" if abs(p["threshold"] - current) < 1e-9 else ""
    return [f"{p['threshold']:.2f}{mark}", f"{p['candidates']:,}", f"{p['new_candidates']:,}"] + [
        f"{p['known_false']:,}",
        f"{p['estimated_false']:,.1f}",
        pct(p["hit_ratio_upper"]),
    ]


def print_tables(s: Summary, console: Console) -> None:
    """The terminal's share of the report: overall, by model and tenant, sweep excerpt, top queries."""
    m = s["meta"]
    title = f"[bold]cachegw analyze[/]: {escape(m['source'])}, {iso(m['since'])} to {iso(m['until'])}"
    console.print(title, soft_wrap=True)
    specs = report_tables(s)
    for key in ("overall", "by_model", "by_tenant", "by_backend", "reasons", "sweep", "top_queries"):
        if (
            key in ("by_backend", "reasons") and not specs[key].rows
        ):  # a log from before backends were recorded
            continue
        table = Table(title=specs[key].title, title_justify="left")
        width = min(16, max((len(row[0]) for row in specs[key].rows), default=0))
        table.add_column(specs[key].headers[0], min_width=width)
        for h in specs[key].headers[1:]:
            table.add_column(h, justify="right")
        for row in specs[key].rows:
            table.add_row(*row)
        console.print(table)


# Page


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")


def sections(s: Summary) -> list[tuple[str, str, list[str], str | None]]:
    """(title, text, table keys, chart) in page order."""
    m, o, cur = s["meta"], s["overall"], s["threshold_sweep"]["current"]
    return [
        (
            "Overview",
            f"Source: {m['source']}. Range: {iso(m['since'])} to {iso(m['until'])}, "
            f"{o['requests']:,} requests, charted in buckets of {_duration(s['timeseries']['bucket_s'])}.",
            ["overall"],
            "hit_ratio_over_time.png",
        ),
        ("Hits by model and tenant", "", ["by_model", "by_tenant"], "hits_by_model_tenant.png"),
        (
            "Similarity",
            "Nearest-neighbour cosine similarity recorded on each semantic lookup, for the semantic hits "
            "and for the misses. Vertical lines: the thresholds in force (most requests: "
            f"{cur['threshold']:.2f}).",
            [],
            "similarity.png",
        ),
        (
            "Threshold sweep",
            "The recorded similarities replayed at other thresholds. Candidates: lookups whose nearest "
            "neighbour clears the threshold (an upper bound on semantic hits, since the verifier still "
            "checks each); new: of those, recorded misses; known false: hits flagged bad; estimated false: "
            "known false plus the new candidates times the flag rate of the served semantic hits.",
            ["sweep"],
            "threshold_sweep.png",
        ),
        (
            "Top repeated queries and scopes",
            "Asked twice or more in the range.",
            ["top_queries", "top_scopes"],
            None,
        ),
        (
            "Miss and bypass reasons",
            "Why requests went to the backend: the cacheability rule of a bypass, or why the nearest "
            "stored answer was refused on a miss (README: x-cache-reason).",
            ["reasons"],
            None,
        ),
        (
            "Backends",
            "The requests each backend answered (misses and bypasses) and its prefix-cache ratio: with "
            "several backends per model, how well routing keeps conversations where their KV blocks are.",
            ["by_backend"],
            None,
        ),
        (
            "Prefix cache by system prompt",
            "Backend prefix-cache ratio (cached prompt tokens / prompt tokens) of the requests the backend "
            "answered (misses and bypasses), per hash of their system messages.",
            ["prefix"],
            "prefix_cache_by_system.png",
        ),
        (
            "Canonicalization rules",
            "For each rule: the requests where it changed the prompt against those where it did not. This is "
            "a correlation, not a controlled experiment: the traffic a rule fires on differs in other ways.",
            ["rules"],
            "rules.png",
        ),
        (
            "Latency and cost saved",
            "Cost saved is an estimate from the config's [pricing]: a hit saves its whole backend call, a "
            "miss the discount on its prefix-cached prompt tokens.",
            ["latency"],
            "latency_cost.png",
        ),
    ]


def _duration(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{seconds // n:.0f} {unit}"
    return f"{seconds:.0f} s"


def write_report(s: Summary, tables: dict[str, TableSpec], charts: list[str], out: Path, fmt: str) -> Path:
    """report.md or report.html in ``out``, the charts referenced by relative path."""
    parts = [
        (t, text, [tables[k] for k in keys], c if c in charts else None) for t, text, keys, c in sections(s)
    ]
    path = out / f"report.{fmt}"
    path.write_text(_markdown(parts) if fmt == "md" else _html(parts), encoding="utf-8")
    return path


Part = tuple[str, str, list[TableSpec], str | None]


def _markdown(parts: list[Part]) -> str:
    lines = ["# cachegw request-log report", ""]
    for title, text, specs, chart in parts:
        lines += [f"## {title}", ""] + ([text, ""] if text else [])
        if chart:
            lines += [f"![{title}]({chart})", ""]
        for spec in specs:
            cell = lambda v: v.replace("|", "\\|")
            lines += [f"**{spec.title}**", "", "| " + " | ".join(spec.headers) + " |"]
            lines.append("|" + "|".join(["---"] + ["---:"] * (len(spec.headers) - 1)) + "|")
            lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in spec.rows] + [""]
    return "\n".join(lines)


CSS = (
    "body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{padding:.2em .7em;border-bottom:1px solid #ddd}"
    "td:not(:first-child),th:not(:first-child){text-align:right}caption{text-align:left;font-weight:bold}"
    "img{max-width:100%}"
)


def _html(parts: list[Part]) -> str:
    e = html.escape
    out = [f"<!doctype html><meta charset=utf-8><title>cachegw report</title><style>{CSS}</style>"]
    out.append("<h1>cachegw request-log report</h1>")
    for title, text, specs, chart in parts:
        out.append(f"<h2>{e(title)}</h2>" + (f"<p>{e(text)}</p>" if text else ""))
        if chart:
            out.append(f'<img src="{e(chart)}" alt="{e(title)}">')
        for spec in specs:
            head = "".join(f"<th>{e(h)}</th>" for h in spec.headers)
            body = "".join("<tr>" + "".join(f"<td>{e(v)}</td>" for v in row) + "</tr>" for row in spec.rows)
            out.append(f"<table><caption>{e(spec.title)}</caption><tr>{head}</tr>{body}</table>")
    return "\n".join(out) + "\n"


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
    ax.set_ylabel(f"requests per {_duration(bucket)}")
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
