"""`cachegw analyze` and `cachegw export`: the request log read back into a report.

Why a command beside the dashboard: a report over days of traffic kept as files (terminal tables, an
HTML or Markdown page, PNG charts, ``summary.json``) that can be diffed, attached to an issue, or read
where no gateway runs. Every number comes from ``gateway.stats``, the code behind the admin API, so the
report and the dashboard agree; a JSONL export analyzes exactly like the database it came from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO
from urllib.parse import quote

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from gateway import stats
from gateway.tables import RequestRecord

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from gateway.config import Settings

Row = dict[str, Any]
COLUMNS = tuple(c.name for c in RequestRecord.__table__.columns)
REQUIRED = ("id", "ts", "tenant", "model", "cache_result")
NUMERIC = ("ts", "similarity", "threshold", "embed_ms", "lookup_ms", "backend_ms", "total_ms")
NUMERIC += ("prompt_tokens", "completion_tokens", "cached_tokens", "status")
TOP_N = 15
NO_UPPER_BOUND = 1e12  # an `until` past any timestamp the log will hold
ROW_LIMIT = 2_000_000  # AdminStore.requests' default cap
err = Console(stderr=True, highlight=False)


def say(line: str) -> None:
    """A status or error line on stderr, unwrapped (rich would wrap it at the terminal's width)."""
    print(line, file=sys.stderr, flush=True)


class AnalyzeError(Exception):
    """Bad input, worded for the user; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class RequestLog:
    rows: list[Row]
    flagged: set[str]  # ids of rows in ``rows`` reported as bad hits
    source: str
    since: float | None  # None: no bound asked for
    until: float | None


# Command lines


def _parser(prog: str, jsonl: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"cachegw {prog}")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--db", metavar="URL", help="SQLAlchemy URL (default: the config's database)")
    src.add_argument("--data-dir", metavar="DIR", help="data dir holding cachegw.db (default from config)")
    if jsonl:
        src.add_argument("--jsonl", metavar="FILE", help="a `cachegw export` file instead of a database")
    p.add_argument("--config", help="config file merged over the packaged config.toml (pricing, tenants)")
    default = "24h for a database, all for a file" if jsonl else "all"
    p.add_argument("--since", help=f"window before now (24h, 7d), ISO date/time (UTC) or all ({default})")
    p.add_argument("--until", help="ISO date/time (UTC) or window before now (default: no bound)")
    return p


def main_export(argv: list[str]) -> int:
    """Write the request log as JSONL, one object per row with a ``flagged`` field."""
    p = _parser("export", jsonl=False)
    p.add_argument("--out", required=True, help="FILE.jsonl, or - for stdout")
    args = p.parse_args(argv)
    return _run("export", lambda: _export(args))


def main_analyze(argv: list[str]) -> int:
    """Read the log over a time range; print tables and write the report folder."""
    p = _parser("analyze", jsonl=True)
    p.add_argument("--out", help="report folder (default <data dir>/report, out of git like the data)")
    p.add_argument("--format", choices=("html", "md"), default="html", help="report page format")
    p.add_argument("--json", action="store_true", help="print summary.json on stdout instead of tables")
    args = p.parse_args(argv)
    return _run("analyze", lambda: _analyze(args))


def _run(prog: str, job: Callable[[], int]) -> int:
    """Input problems become one `cachegw PROG: error: ...` line and an exit status, not a traceback."""
    try:
        return job()
    except AnalyzeError as exc:
        say(f"cachegw {prog}: error: {exc}")
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `cachegw export --out - | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _export(args: argparse.Namespace) -> int:
    settings = _settings(args.config, args.data_dir)
    since, until = _range(args.since, args.until, default_since=None)
    log = read_database(args.db or settings.gateway.resolved_database_url(settings.data_dir), since, until)
    with _output(args.out) as f:
        for row in log.rows:
            f.write(json.dumps({**row, "flagged": row["id"] in log.flagged}, ensure_ascii=False) + "\n")
    where = "stdout" if args.out == "-" else args.out
    say(f"wrote {len(log.rows):,} requests ({len(log.flagged)} flagged) to {where}")
    return 0


def _analyze(args: argparse.Namespace) -> int:
    from gateway.report_plots import draw_charts, print_tables, report_tables, write_report

    settings = _settings(args.config, args.data_dir)
    if args.jsonl:
        since, until = _range(args.since, args.until, default_since=None)
        log = read_jsonl(Path(args.jsonl), since, until)
    else:
        since, until = _range(args.since, args.until, default_since="24h")
        log = read_database(
            args.db or settings.gateway.resolved_database_url(settings.data_dir), since, until
        )
    if not log.rows:
        hint = " (a wider --since? e.g. --since 7d or --since all)" if since is not None else ""
        raise AnalyzeError(f"no requests in {log.source} {_span_text(since, until)}{hint}", code=1)
    with err.status(f"computing statistics over {len(log.rows):,} requests"):
        summary = build_summary(log, settings)
    if not args.jsonl:
        from gateway.false_hit_report import read_false_hits

        false_hits = read_false_hits(
            args.db or settings.gateway.resolved_database_url(settings.data_dir), settings
        )
        if false_hits.get("by_scope"):  # none recorded: the summary stays what a JSONL export gives
            summary["false_hit_rate"] = false_hits
    out = Path(args.out) if args.out else settings.data_dir / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        charts = draw_charts(summary, out, _progress)
        page = write_report(summary, report_tables(summary), charts, out, args.format)
    except OSError as exc:
        raise AnalyzeError(f"cannot write the report to {out}: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print_tables(summary, Console(highlight=False, width=None if sys.stdout.isatty() else 160))
        from gateway.false_hit_report import print_false_hits

        print_false_hits(summary.get("false_hit_rate") or {})
    say(f"wrote {page}, summary.json and {len(charts)} charts")
    return 0


def _settings(config: str | None, data_dir: str | None) -> Settings:
    from gateway.config import load_settings

    try:
        return load_settings(config, data_dir=data_dir)
    except OSError as exc:
        raise AnalyzeError(f"cannot read the config {config}: {exc.strerror or exc}") from None
    except ValueError as exc:  # TOML syntax and pydantic validation errors
        raise AnalyzeError(f"bad config {config}: {exc}") from None


@contextmanager
def _output(path: str) -> Iterator[TextIO]:
    if path == "-":
        yield sys.stdout
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            yield f
    except OSError as exc:
        raise AnalyzeError(f"cannot write {path}: {exc.strerror or exc}") from None


# Time range


def parse_time(text: str, flag: str, now: float) -> float | None:
    """'24h' or '7d' (that long before now), 'all' (no bound), or an ISO date/time, naive meaning UTC."""
    if text.strip().lower() == "all":
        return None
    try:
        return now - stats.parse_window(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.strip())
    except ValueError:
        raise AnalyzeError(
            f"{flag} {text!r}: expected a window like 24h or 7d, an ISO date or time like 2025-01-31 "
            "or 2025-01-31T14:00, or all"
        ) from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


def _range(
    since: str | None, until: str | None, default_since: str | None
) -> tuple[float | None, float | None]:
    now = time.time()
    lo = parse_time(since or default_since or "all", "--since", now)
    hi = parse_time(until, "--until", now) if until else None
    if lo is not None and hi is not None and lo >= hi:
        raise AnalyzeError(f"--since ({iso(lo)}) must come before --until ({iso(hi)})")
    return lo, hi


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _span_text(since: float | None, until: float | None) -> str:
    lo, hi = ("the start" if since is None else iso(since)), ("now" if until is None else iso(until))
    return f"from {lo} to {hi}"


def _in_range(ts: float, since: float | None, until: float | None) -> bool:
    return (since is None or ts >= since) and (until is None or ts < until)


# Reading the log


def open_database(url: str) -> tuple[Engine, str]:
    """An engine on an existing database, SQLite read-only (a typo must not leave an empty db behind)."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    try:
        u = make_url(url)
        shown = u.render_as_string(hide_password=True)
        if u.get_backend_name() == "sqlite" and u.database and not u.database.startswith("file:"):
            path = Path(u.database).expanduser()
            if not path.is_file():
                raise AnalyzeError(f"no database at {path} (give --db URL, --data-dir DIR or --jsonl FILE)")
            url = f"sqlite:///file:{quote(str(path.resolve()))}?mode=ro&uri=true"
        return create_engine(url), shown
    except AnalyzeError:
        raise
    except Exception as exc:  # bad URL syntax, unknown dialect, driver not installed
        raise AnalyzeError(f"cannot open database {url!r}: {_first_line(exc)}") from None


def read_database(url: str, since: float | None, until: float | None) -> RequestLog:
    """Rows through AdminStore.requests (what the admin API reads), flagged ids from the feedback."""
    from sqlalchemy import inspect
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.orm import sessionmaker

    from gateway.admin_store import AdminStore

    engine, shown = open_database(url)
    try:
        with err.status(f"reading the request log from {shown}"):
            tables = set(inspect(engine).get_table_names())
            if "requests" not in tables:
                raise AnalyzeError(f"{shown} has no `requests` table: not a cachegw database")
            have = {c["name"] for c in inspect(engine).get_columns("requests")}
            if missing := [c for c in COLUMNS if c not in have]:
                raise AnalyzeError(
                    f"{shown}: the requests table lacks columns {', '.join(missing)} "
                    "(an older cachegw made it; `cachegw serve` once upgrades it)"
                )
            admin = AdminStore(sessionmaker(engine))
            rows = admin.requests(since or 0.0, until or NO_UPPER_BOUND, limit=ROW_LIMIT)
            ids = {r["id"] for r in rows}
            flagged = set(admin.flagged_request_ids(since or 0.0)) & ids if "feedback" in tables else set()
    except SQLAlchemyError as exc:
        raise AnalyzeError(f"cannot read the request log from {shown}: {_first_line(exc)}") from None
    finally:
        engine.dispose()
    if len(rows) == ROW_LIMIT:
        say(f"warning: only the first {ROW_LIMIT:,} requests were read; narrow --since/--until")
    say(f"read {len(rows):,} requests ({len(flagged)} flagged) from {shown}")
    return RequestLog(rows, flagged, shown, since, until)


def read_jsonl(path: Path, since: float | None, until: float | None) -> RequestLog:
    """A `cachegw export` file: validated line by line, so a bad line is named, not a traceback."""
    try:
        size = path.stat().st_size
        f = path.open("rb")
    except OSError as exc:
        raise AnalyzeError(f"cannot read {path}: {exc.strerror or exc}") from None
    rows: list[Row] = []
    flagged: set[str] = set()
    seen = 0
    with f, _progress(f"reading {path.name}", size, bytes_=True) as advance:
        for n, raw in enumerate(f, 1):
            advance(len(raw))
            if not raw.strip():
                continue
            row, bad = parse_line(raw, n)
            seen += 1
            if _in_range(row["ts"], since, until):
                rows.append(row)
                if bad:
                    flagged.add(row["id"])
    if not seen:
        raise AnalyzeError(f"{path} is empty: no request rows in it")
    rows.sort(key=lambda r: r["ts"])  # as the database returns them
    say(f"read {len(rows):,} of {seen:,} requests ({len(flagged)} flagged) from {path}")
    return RequestLog(rows, flagged, str(path), since, until)


def parse_line(raw: bytes, n: int) -> tuple[Row, bool]:
    """One request-log row (every column, absent optional ones as null) and its flagged mark."""
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        raise AnalyzeError(f"line {n} is not UTF-8 text") from None
    except ValueError as exc:
        raise AnalyzeError(f"line {n} is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise AnalyzeError(
            f"line {n}: expected a JSON object (one request-log row), got {type(obj).__name__}"
        )
    if missing := [c for c in REQUIRED if obj.get(c) is None]:
        raise AnalyzeError(f"line {n}: missing required columns {', '.join(missing)}")
    for c in NUMERIC:
        v = obj.get(c)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise AnalyzeError(f"line {n}: column {c} must be a number, got {v!r}")
    if not isinstance(obj["cache_result"], str):
        raise AnalyzeError(f"line {n}: column cache_result must be a string")
    return {c: obj.get(c) for c in COLUMNS}, bool(obj.get("flagged"))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


@contextmanager
def _progress(label: str, total: float, bytes_: bool = False) -> Iterator[Callable[[float], None]]:
    """A rich progress bar on a terminal's stderr; nothing elsewhere (logs and tests stay clean)."""
    if not err.is_terminal:
        yield lambda _step: None
        return
    cols = [TextColumn("{task.description}"), BarColumn()]
    cols += [DownloadColumn()] if bytes_ else [TextColumn("{task.completed:.0f}/{task.total:.0f}")]
    with Progress(*cols, TimeRemainingColumn(), console=err, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda step: bar.advance(task, step)


# Numbers


def build_summary(log: RequestLog, settings: Settings) -> dict[str, Any]:
    """Every number the report shows, computed by gateway.stats where it has the function."""
    from gateway.tenants import Tenants

    rows, pricing = log.rows, settings.pricing
    flagged = sorted(log.flagged)
    t0 = log.since if log.since is not None else rows[0]["ts"]
    t1 = log.until if log.until is not None else rows[-1]["ts"] + 1e-3
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
    seen = Counter(float(r["threshold"]) for r in stats.semantic_rows(rows) if r.get("threshold") is not None)
    return (seen.most_common(1)[0][0] if seen else configured), sorted(seen)


def top_repeated(rows: Sequence[Row], key: str, n: int = TOP_N) -> list[dict[str, Any]]:
    """The most repeated values of ``key`` (asked twice or more), with how many of them were hits."""
    groups = stats.group((r for r in rows if r.get(key)), key)
    out = []
    for value, count in stats.top(rows, key, n):
        if count < 2:
            break
        g = groups[value]
        text = next((r["query"] for r in g if r.get("query")), None)
        hits = sum(1 for r in g if r.get("cache_result") in stats.HITS)
        out.append({key: value, "query": text, "requests": count, "hits": hits})
    return out


def _backend_rows(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r.get("cache_result") in ("miss", "bypass")]


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
    fired = [set(filter(None, (r.get("rules_fired") or "").split(","))) for r in rows]
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
