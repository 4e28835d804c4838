"""The request log read for `cachegw analyze`: from the database (through ``AdminStore``, as the admin API
reads it) or from a JSONL export, checked line by line, within a time range.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from cachegw.gateway.storage.request_record import CacheResult, RequestRecord
from cachegw.gateway.storage.tables import RequestRow

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

Row = RequestRecord
COLUMNS = tuple(c.name for c in RequestRow.__table__.columns)
RESULTS = tuple(r.value for r in CacheResult)
REQUIRED = ("id", "ts", "tenant", "model", "cache_result")
NUMERIC = ("ts", "similarity", "threshold", "embed_ms", "lookup_ms", "backend_ms", "total_ms") + (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "status",
)
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


def in_range(ts: float, since: float | None, until: float | None) -> bool:
    return (since is None or ts >= since) and (until is None or ts < until)


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
        raise AnalyzeError(f"cannot open database {url!r}: {first_line(exc)}") from None


def read_database(url: str, since: float | None, until: float | None) -> RequestLog:
    """Rows through AdminStore.requests (what the admin API reads), flagged ids from the feedback."""
    from sqlalchemy import inspect
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.orm import sessionmaker

    from cachegw.gateway.storage.admin_store import AdminStore

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
            ids = {r.id for r in rows}
            flagged = set(admin.flagged_request_ids(since or 0.0)) & ids if "feedback" in tables else set()
    except SQLAlchemyError as exc:
        raise AnalyzeError(f"cannot read the request log from {shown}: {first_line(exc)}") from None
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
    with f, progress_bar(f"reading {path.name}", size, bytes_=True) as advance:
        for n, raw in enumerate(f, 1):
            advance(len(raw))
            if not raw.strip():
                continue
            row, bad = parse_line(raw, n)
            seen += 1
            if in_range(row.ts, since, until):
                rows.append(row)
                if bad:
                    flagged.add(row.id)
    if not seen:
        raise AnalyzeError(f"{path} is empty: no request rows in it")
    rows.sort(key=lambda r: r.ts)  # as the database returns them
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
    if obj["cache_result"] not in RESULTS:
        raise AnalyzeError(f"line {n}: column cache_result must be one of {', '.join(RESULTS)}")
    return RequestRecord.from_dict({c: obj.get(c) for c in COLUMNS}), bool(obj.get("flagged"))


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


@contextmanager
def progress_bar(label: str, total: float, bytes_: bool = False) -> Iterator[Callable[[float], None]]:
    """A rich progress bar on a terminal's stderr; nothing elsewhere (logs and tests stay clean)."""
    if not err.is_terminal:
        yield lambda _step: None
        return
    cols = [TextColumn("{task.description}"), BarColumn()]
    cols += [DownloadColumn()] if bytes_ else [TextColumn("{task.completed:.0f}/{task.total:.0f}")]
    with Progress(*cols, TimeRemainingColumn(), console=err, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda step: bar.advance(task, step)
