"""The entries' change feed: which entries any replica created, updated or deleted since a time.

Created and updated entries are found by their own timestamps; a deleted entry leaves a row in
``entry_deletions``, written in the same transaction as the delete (``delete_logged``), so another
replica's sync drops it too. The rows are pruned once every replica has had time to read them.
"""

from __future__ import annotations

import time

from sqlalchemy import delete, exists, select
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session, sessionmaker

from cachegw.gateway.storage.tables import CacheEntry, EntryDeletion


def delete_logged(conn: Connection | Session, gone: list[tuple[int, int]]) -> None:
    """Delete entries by (id, size) and log their deletion in the same transaction."""
    if not gone:
        return
    conn.execute(delete(CacheEntry).where(CacheEntry.id.in_([i for i, _ in gone])))
    log_deletions(conn, gone)


def log_deletions(conn: Connection | Session, gone: list[tuple[int, int]]) -> None:
    """So other replicas drop the entries too (``SqlChanges.changes_since``)."""
    if gone:
        now = time.time()
        rows = [{"entry_id": i, "size_bytes": size, "ts": now} for i, size in gone]
        conn.execute(EntryDeletion.__table__.insert(), rows)  # type: ignore[attr-defined]


class SqlChanges:
    """``ChangeFeed`` over the entries table and its deletion log."""

    def __init__(self, session: sessionmaker[Session]) -> None:
        self.session = session

    def changes_since(self, since: float) -> tuple[list[tuple[int, bool]], list[tuple[int, int]]]:
        """What any replica changed from ``since`` on: ([(id, updated)] of entries created or updated,
        [(id, size_bytes)] of entries deleted). Ids only; the caller fetches the entries it does not
        know yet."""
        with self.session() as s:
            rows = s.execute(
                select(CacheEntry.id, CacheEntry.updated_at).where(
                    (CacheEntry.created_at >= since) | (CacheEntry.updated_at >= since)
                )
            ).all()
            # an id back in the table was reused (databases made before ids were AUTOINCREMENT): keep it
            reused = exists().where(CacheEntry.id == EntryDeletion.entry_id)
            q = select(EntryDeletion.entry_id, EntryDeletion.size_bytes).where(
                EntryDeletion.ts >= since, ~reused
            )
            deleted = [(int(i), int(size)) for i, size in s.execute(q)]
            return [(int(i), u is not None and u >= since) for i, u in rows], deleted

    def prune_deletions(self, before: float) -> None:
        with self.session.begin() as s:
            s.execute(delete(EntryDeletion).where(EntryDeletion.ts < before))
