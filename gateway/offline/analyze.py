"""`cachegw analyze` and `cachegw export`: the request log read back into a report.

Why a command beside the dashboard: a report over days of traffic kept as files (terminal tables, an
HTML or Markdown page, PNG charts, ``summary.json``) that can be diffed, attached to an issue, or read
where no gateway runs. Every number comes from ``storage/stats.py``, the code behind the admin API, so the
report and the dashboard agree; a JSONL export analyzes exactly like the database it came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from rich.console import Console

from cachegw.gateway.offline.analyze_summary import build_summary
from cachegw.gateway.storage import stats
from cachegw.gateway.storage.request_log import (
    AnalyzeError,
    err,
    progress_bar,
    read_database,
    read_jsonl,
    say,
)

if TYPE_CHECKING:
    from cachegw.gateway.config import Settings


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
            line = {**dataclasses.asdict(row), "flagged": row.id in log.flagged}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    where = "stdout" if args.out == "-" else args.out
    say(f"wrote {len(log.rows):,} requests ({len(log.flagged)} flagged) to {where}")
    return 0


def _analyze(args: argparse.Namespace) -> int:
    from cachegw.gateway.offline.report_page import write_report
    from cachegw.gateway.offline.report_plots import draw_charts
    from cachegw.gateway.offline.report_tables import print_tables, report_tables

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
        from cachegw.gateway.offline.false_hit_report import read_false_hits

        false_hits = read_false_hits(
            args.db or settings.gateway.resolved_database_url(settings.data_dir), settings
        )
        if false_hits.get("by_scope"):  # none recorded: the summary stays what a JSONL export gives
            summary["false_hit_rate"] = false_hits
    out = Path(args.out) if args.out else settings.data_dir / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        charts = draw_charts(summary, out, progress_bar)
        page = write_report(summary, report_tables(summary), charts, out, args.format)
    except OSError as exc:
        raise AnalyzeError(f"cannot write the report to {out}: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print_tables(summary, Console(highlight=False, width=None if sys.stdout.isatty() else 160))
        from cachegw.gateway.offline.false_hit_report import print_false_hits

        print_false_hits(summary.get("false_hit_rate") or {})
    say(f"wrote {page}, summary.json and {len(charts)} charts")
    return 0


def _settings(config: str | None, data_dir: str | None) -> Settings:
    from cachegw.gateway.config import load_settings

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


# Reading the log


# Numbers
