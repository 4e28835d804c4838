"""The change log: what any replica changed, read by position.

Every store, flag, learned threshold and delete of an entry, every change of the live settings, every
row of false-hit evidence and every learned volatile template writes a ``change_log`` row in the
change's own transaction (``log_changes``), so the row exists
exactly when the change does; on PostgreSQL the same transaction sends ``NOTIFY`` on
``CHANNEL`` (delivered at commit) for the replicas' listeners (``gateway/storage/notify.py``).

A reader keeps a ``Cursor``: a position below which it has read every row. No clock decides it:

- SQLite serializes writers, so a row's id is its commit order: the position is the id, and the
  reader moves past the highest id it read.
- PostgreSQL hands out ids before commit, so a transaction holding id 7 may commit after one holding
  8. Each row records its transaction's id (``xact``, 64 bits: it never wraps) and the position is
  that. A read takes its snapshot's ``xmin``: every transaction below it has finished, so all of
  their rows are in the snapshot, and the next read starts there. Rows of transactions at or above
  ``xmin`` are read again until ``xmin`` passes them, and the ids already applied are skipped.

The log is pruned to its newest rows (``prune``); the position it was cut at is kept
(``change_log_pruned``), and a reader whose cursor is below it may have missed rows, so it reloads
its views from the tables instead (``ChangeBatch.lost``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Engine,
    Text,
    case,
    cast,
    delete,
    func,
    insert,
    select,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from cachegw.gateway.storage.tables import CacheEntry, ChangeLogPruned, ChangeRow

CHANNEL = "cachegw_changes"  # PostgreSQL NOTIFY channel of the change log


class ChangeKind(StrEnum):
    STORE = "store"  # a new entry
    UPDATE = "update"  # an entry flagged bad or given a learned threshold: re-read it
    DELETE = "delete"  # an entry deleted (evicted, expired, replaced, purged)
    SETTINGS = "settings"  # the live settings changed
    EVIDENCE = "evidence"  # a row of false-hit evidence (``entry_id``: its ``hit_audits`` id)
    TEMPLATE = "template"  # a learned volatile template (``entry_id``: its ``volatile_templates`` id)


ENTRY_KINDS = frozenset({ChangeKind.STORE, ChangeKind.UPDATE, ChangeKind.DELETE})


@dataclass(frozen=True)
class Change:
    """One row of the log: what changed and which row (an entry, or the evidence or template row its
    kind names; a deleted entry's size too)."""

    kind: ChangeKind
    entry_id: int | None = None
    size_bytes: int = 0
    id: int = 0  # its position in the log once written


@dataclass(frozen=True)
class Cursor:
    """Where a reader stands: every row at a position below ``horizon`` has been read; ``seen`` holds
    the ids read at or above it (PostgreSQL), which the next read returns again."""

    horizon: int = 0
    seen: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class ChangeBatch:
    changes: list[Change]  # new to the reader, in id order
    cursor: Cursor  # where it stands after them
    lost: bool  # rows it had not read were pruned: it must reload its views from the tables


def _xact() -> ColumnElement[int]:
    """The writing transaction's id, 64 bits (PostgreSQL's xid8 has no direct cast to bigint)."""
    return cast(cast(func.pg_current_xact_id(), Text), BigInteger)


def _snapshot_xmin() -> ColumnElement[int]:
    return cast(cast(func.pg_snapshot_xmin(func.pg_current_snapshot()), Text), BigInteger)


def log_changes(s: Connection | Session, changes: Iterable[Change]) -> None:
    """Write ``changes`` into the caller's transaction (and, on PostgreSQL, notify at its commit)."""
    rows = [{"kind": c.kind.value, "entry_id": c.entry_id, "size_bytes": c.size_bytes} for c in changes]
    if not rows:
        return
    bind = s if isinstance(s, Connection) else s.get_bind()
    postgres = bind.dialect.name == "postgresql"
    stmt = insert(ChangeRow)
    if postgres:
        stmt = stmt.values(xact=_xact())
    s.execute(stmt, rows)
    if postgres:  # one notification per transaction, whatever it wrote
        s.execute(select(func.pg_notify(CHANNEL, "")))


def delete_logged(s: Connection | Session, gone: list[tuple[int, int]]) -> None:
    """Delete entries by (id, size) and log their deletion in the same transaction."""
    if not gone:
        return
    s.execute(delete(CacheEntry).where(CacheEntry.id.in_([i for i, _ in gone])))
    log_changes(s, [Change(ChangeKind.DELETE, i, size) for i, size in gone])


class SqlChanges:
    """``ChangeFeed`` over the ``change_log`` table."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.postgres = engine.dialect.name == "postgresql"
        self.position = ChangeRow.xact if self.postgres else ChangeRow.id

    def start(self) -> Cursor:
        """The position now: a reader that loads its views from the tables after this call and then
        reads from here misses nothing (what it reads twice, it finds already applied)."""
        with self.engine.connect() as conn:
            if self.postgres:
                return Cursor(int(conn.scalar(select(_snapshot_xmin())) or 0))
            return Cursor(int(conn.scalar(select(func.max(ChangeRow.id))) or 0) + 1)

    def read(self, cursor: Cursor) -> ChangeBatch:
        """The rows after ``cursor``, and where the reader stands after them."""
        cols = (ChangeRow.id, ChangeRow.kind, ChangeRow.entry_id, ChangeRow.size_bytes, self.position)
        with self.engine.connect() as conn:
            if self.postgres:  # one snapshot for the horizon, the rows and the pruned mark
                conn = conn.execution_options(isolation_level="REPEATABLE READ")
                horizon = int(conn.scalar(select(_snapshot_xmin())) or 0)
            q = select(*cols).where(self.position >= cursor.horizon).order_by(ChangeRow.id)
            rows = conn.execute(q).all()
            # read after the rows: a prune that removed any of them before they were read shows here
            pruned = int(conn.scalar(select(ChangeLogPruned.below).where(ChangeLogPruned.id == 1)) or 0)
        if not self.postgres:  # ids are commit order: the next read starts after the last one
            horizon = max((r[0] for r in rows), default=cursor.horizon - 1) + 1
        new = [
            Change(ChangeKind(kind), entry_id, size, i) for i, kind, entry_id, size, _ in rows
            if i not in cursor.seen
        ]  # fmt: skip
        seen = frozenset(r[0] for r in rows if r[4] is not None and r[4] >= horizon)
        return ChangeBatch(new, Cursor(horizon, seen), lost=pruned > cursor.horizon)

    def newest(self) -> int:
        """The highest id written so far (0: none)."""
        with self.engine.connect() as conn:
            return int(conn.scalar(select(func.max(ChangeRow.id))) or 0)

    def prune(self, keep: int) -> int:
        """Delete all but about the newest ``keep`` rows; returns how many went. Only rows of finished
        transactions go (PostgreSQL: below the snapshot's xmin), so the cut is exact: a reader below
        it reloads, one at or above it has lost nothing."""
        with self.engine.begin() as conn:
            cut = conn.scalar(select(self.position).order_by(ChangeRow.id.desc()).offset(keep).limit(1))
            if cut is None:
                return 0
            below = int(cut) + 1
            if self.postgres:
                below = min(below, int(conn.scalar(select(_snapshot_xmin())) or 0))
            gone = conn.execute(delete(ChangeRow).where(self.position < below)).rowcount
            ins = (pg_insert if self.postgres else sqlite_insert)(ChangeLogPruned)
            table = ChangeLogPruned.__table__
            higher = case((ins.excluded.below > table.c.below, ins.excluded.below), else_=table.c.below)
            conn.execute(
                ins.values(id=1, below=below).on_conflict_do_update(
                    index_elements=["id"], set_={"below": higher}
                )
            )
            return int(gone)
