"""The page of a `cachegw analyze` report, HTML or Markdown: its sections in order, each a heading,
text, tables and a chart, from the summary dict alone.
"""

from __future__ import annotations

import html
from pathlib import Path

from cachegw.gateway.offline.report_tables import Summary, TableSpec, duration, iso


def sections(s: Summary) -> list[tuple[str, str, list[str], str | None]]:
    """(title, text, table keys, chart) in page order."""
    m, o, cur = s["meta"], s["overall"], s["threshold_sweep"]["current"]
    return [
        (
            "Overview",
            f"Source: {m['source']}. Range: {iso(m['since'])} to {iso(m['until'])}, "
            f"{o['requests']:,} requests, charted in buckets of {duration(s['timeseries']['bucket_s'])}.",
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
            "stored answer was refused on a miss (docs/caching.md: x-cache-reason).",
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
