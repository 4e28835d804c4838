"""The tables of a `cachegw analyze` report (terminal, and the page's) from the summary dict, with the
number formats the page and the charts share.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

Summary = dict[str, Any]


TOP_N = 15


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


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")


def duration(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{seconds // n:.0f} {unit}"
    return f"{seconds:.0f} s"
