"""The database, and the SQL stores of what an answer writes: its cache entry and its reply texts.

``Store`` opens the database (SQLAlchemy 2 on any URL; SQLite, the default in the data dir, runs in
WAL mode so readers never wait for the writer and a kill -9 loses nothing that was committed); each
table's store takes its sessions: ``SqlEntries`` and ``SqlReplies`` here (one commit holds an entry
and its replies), the change log (``changes.py``), the request log (``recorder.py``), the admin side
(``admin_store.py``) and the false-hit evidence (``evidence_store.py``). ``sql_stores`` builds the
cache's. Every method is synchronous and short: the app calls them from worker threads.

One live entry per exact key: storing an answer retires the key's other live entries in the same
transaction (``put_entry``), and on SQLite and PostgreSQL a unique partial index over the live rows
(``ux_entries_live_key``) makes a second copy impossible even when two replicas store the same key at
once (the later commit fails, and is retried, then replacing the first). A flagged (bad) entry is
not live: it stays as the record of the feedback while the key takes a new answer. A database made
before the index has its copies retired when it is upgraded (migration 0008), the newest kept.

Opening a store upgrades its database to the models' schema first (``gateway/storage/migrate.py``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from alembic.util import CommandError
from sqlalchemy import create_engine, delete, event, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import (
    Session,
    make_transient,
    sessionmaker,
)

from cachegw.gateway.storage.changes import Change, ChangeKind, SqlChanges, delete_logged, log_changes
from cachegw.gateway.storage.interfaces import CacheStores
from cachegw.gateway.storage.migrate import upgrade
from cachegw.gateway.storage.tables import CacheEntry, Reply
from cachegw.policies.canonicalize import Restore

log = logging.getLogger("cachegw.gateway")

PUT_ATTEMPTS = 3  # a store that lost a race for its key's unique slot replaces the winner on retry


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=5000")
    cur.close()


def _key_lock_id(entry: CacheEntry) -> int:
    """A signed 64-bit number naming one exact key, for PostgreSQL's advisory locks."""
    name = f"{entry.tenant}\x00{entry.model}\x00{entry.exact_key}".encode()
    return int.from_bytes(hashlib.sha256(name).digest()[:8], "big", signed=True)


def _retire_key(s: Session, entry: CacheEntry) -> list[tuple[int, int]]:
    """Delete the live entries of ``entry``'s exact key (logged); their [(id, size)]."""
    table = CacheEntry.__table__
    live = (
        table.c.tenant == entry.tenant,
        table.c.model == entry.model,
        table.c.exact_key == entry.exact_key,
        table.c.bad.is_(False),
    )
    if s.get_bind().dialect.delete_returning:  # SQLite >= 3.35, PostgreSQL: one statement
        rows = s.execute(delete(table).where(*live).returning(table.c.id, table.c.size_bytes)).all()
        gone = [(int(i), int(size)) for i, size in rows]
        log_changes(s, [Change(ChangeKind.DELETE, i, size) for i, size in gone])
        return gone
    gone = [(int(i), int(size)) for i, size in s.execute(select(table.c.id, table.c.size_bytes).where(*live))]
    delete_logged(s, gone)
    return gone


def reply_key(tenant: str, normalized_text: str) -> str:
    """Per tenant: one tenant's replies must never shape, or reveal themselves in, another's prompts."""
    return hashlib.sha256(f"{tenant}\x00{normalized_text}".encode()).hexdigest()


class StoreError(RuntimeError):
    """The database cannot be opened: a missing driver, a server that refuses, bad credentials."""


class Store:
    """The database, opened and upgraded to the models' schema; each table's store takes its sessions."""

    def __init__(self, url: str, clock: Callable[[], float] = time.time) -> None:
        """``clock`` is the wall clock of expiry and reply ages (tests give one they can move); the
        stores built on this database read it."""
        self.clock = clock
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        try:
            self.engine = create_engine(url, pool_pre_ping=True)
            if self.engine.dialect.name == "sqlite":
                event.listen(self.engine, "connect", _sqlite_pragmas)
            upgrade(self.engine)
        except (ImportError, ArgumentError, SQLAlchemyError, CommandError) as exc:
            shown = make_url(url).render_as_string(hide_password=True) if "://" in url else url
            hint = ""
            if isinstance(exc, ImportError):
                pg = url.startswith("postgresql")
                hint = " (pip install 'cachegw[postgres]')" if pg else " (install the driver the URL names)"
            reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
            raise StoreError(f"cannot open the database {shown}: {reason}{hint}") from exc
        self.session = sessionmaker(self.engine, expire_on_commit=False)

    def close(self) -> None:
        self.engine.dispose()


class SqlReplies:
    """``ReplyStore`` in the ``replies`` table."""

    def __init__(self, session: sessionmaker[Session], clock: Callable[[], float]) -> None:
        self.session, self.clock = session, clock

    def remember_replies(self, replies: dict[str, str]) -> None:
        """key -> exact text; an existing key keeps its first text."""
        if not replies:
            return
        with self.session.begin() as s:
            self.add_replies(s, replies)

    def add_replies(self, s: Session, replies: dict[str, str]) -> None:
        """In the caller's transaction (``SqlEntries.put_entry``). Insert-or-ignore: two answers with
        the same text committing at once must not fail each other's commit (it holds the entry too)."""
        now = self.clock()
        rows = [{"key": k, "text": t, "created_at": now} for k, t in replies.items()]
        dialect = s.get_bind().dialect.name
        if dialect in ("sqlite", "postgresql"):
            insert = sqlite_insert if dialect == "sqlite" else pg_insert
            s.execute(insert(Reply).values(rows).on_conflict_do_nothing(index_elements=["key"]))
            return
        known = set(s.scalars(select(Reply.key).where(Reply.key.in_(list(replies)))))
        s.add_all(Reply(**row) for row in rows if row["key"] not in known)

    def prune_replies(self, before: float) -> None:
        with self.session.begin() as s:
            s.execute(delete(Reply).where(Reply.created_at < before))

    def clear_replies(self) -> None:
        with self.session.begin() as s:
            s.execute(delete(Reply))

    def reply_restorer(self, tenant: str) -> Restore:
        """The tenant's earlier replies by their normalized text (canonicalization restores their bytes)."""
        return lambda normalized: self.lookup_reply(reply_key(tenant, normalized))

    def lookup_reply(self, key: str) -> str | None:
        with self.session() as s:
            return s.scalar(select(Reply.text).where(Reply.key == key))


class SqlEntries:
    """``EntryStore`` in the ``cache_entries`` table; an entry's reply texts go to ``replies`` in the
    same commit."""

    def __init__(
        self, session: sessionmaker[Session], clock: Callable[[], float], replies: SqlReplies
    ) -> None:
        self.session, self.clock, self.replies = session, clock, replies

    def add_entry(self, entry: CacheEntry, replies: dict[str, str] | None = None) -> int:
        """``put_entry``, for callers that do not keep their own view of the entries."""
        return self.put_entry(entry, replies)[0]

    def put_entry(
        self, entry: CacheEntry, replies: dict[str, str] | None = None
    ) -> tuple[int, list[tuple[int, int]]]:
        """Store an entry as the one live answer of its exact key, and the reply texts of the same
        answer, in one commit; (its id, [(id, size)] of the live entries of the key it replaced).

        The key's old entries are deleted first: on SQLite that statement takes the write lock, on
        PostgreSQL a transaction-scoped advisory lock on the key comes first, so writers of one key
        take turns and each replaces the last. A writer that still loses the race to the unique
        index (another dialect, a replica of an older cachegw) retries and replaces the winner."""
        for attempt in range(PUT_ATTEMPTS):
            try:
                with self.session.begin() as s:
                    if s.get_bind().dialect.name == "postgresql":
                        s.execute(select(func.pg_advisory_xact_lock(_key_lock_id(entry))))
                    replaced = _retire_key(s, entry)
                    if replies:
                        self.replies.add_replies(s, replies)
                    s.add(entry)
                    s.flush()
                    log_changes(s, [Change(ChangeKind.STORE, entry.id)])
                    return entry.id, replaced
            except IntegrityError:  # another writer committed the same key first: replace it
                if attempt == PUT_ATTEMPTS - 1:
                    raise
                make_transient(entry)
        raise AssertionError("unreachable")

    def get_entries(self, ids: list[int]) -> dict[int, CacheEntry]:
        if not ids:
            return {}
        with self.session() as s:
            return {e.id: e for e in s.scalars(select(CacheEntry).where(CacheEntry.id.in_(ids)))}

    def find_exact(self, tenant: str, model: str, exact_key: str, now: float) -> list[CacheEntry]:
        """Live entries for an identical request, newest first."""
        with self.session() as s:
            q = (
                select(CacheEntry)
                .where(
                    CacheEntry.tenant == tenant, CacheEntry.model == model, CacheEntry.exact_key == exact_key
                )
                .where(CacheEntry.expires_at > now, CacheEntry.bad.is_(False))
                .order_by(CacheEntry.id.desc())
                .limit(4)
            )
            return list(s.scalars(q))

    def record_hits(self, hits: dict[int, tuple[int, float]]) -> None:
        """Add hit counts and last-hit times, {entry id: (hits, last time)}, in one transaction."""
        if not hits:
            return
        with self.session.begin() as s:
            for entry_id, (n, last) in hits.items():
                s.execute(
                    update(CacheEntry)
                    .where(CacheEntry.id == entry_id)
                    .values(hit_count=CacheEntry.hit_count + n, last_hit_at=last)
                )

    def mark_bad(self, entry_id: int) -> None:
        self._update_entry(entry_id, bad=True)

    def set_entry_threshold(self, entry_id: int, threshold: float) -> None:
        self._update_entry(entry_id, threshold=threshold)

    def _update_entry(self, entry_id: int, **values: object) -> None:
        with self.session.begin() as s:
            q = update(CacheEntry).where(CacheEntry.id == entry_id)
            s.execute(q.values(**values, updated_at=time.time()))
            log_changes(s, [Change(ChangeKind.UPDATE, entry_id)])  # of a gone entry: read as nothing

    def delete_entries(self, ids: list[int]) -> int:
        """Delete entries and log their ids in the same commit (other replicas read the change log)."""
        if not ids:
            return 0
        with self.session.begin() as s:
            gone = s.execute(select(CacheEntry.id, CacheEntry.size_bytes).where(CacheEntry.id.in_(ids))).all()
            delete_logged(s, [(int(i), int(size)) for i, size in gone])
            return len(gone)

    def expired_ids(self, now: float) -> list[int]:
        with self.session() as s:
            return list(s.scalars(select(CacheEntry.id).where(CacheEntry.expires_at <= now)))

    def totals(self) -> tuple[int, int]:
        """(entries, stored response bytes)."""
        with self.session() as s:
            n, size = s.execute(
                select(func.count(CacheEntry.id), func.coalesce(func.sum(CacheEntry.size_bytes), 0))
            ).one()
            return int(n), int(size)

    def eviction_order(self, policy: str, limit: int) -> list[tuple[int, int]]:
        """(id, size) of the entries to evict first: least recently or least frequently used."""
        recency = func.coalesce(CacheEntry.last_hit_at, CacheEntry.created_at)
        order = [recency] if policy == "lru" else [CacheEntry.hit_count, recency]
        with self.session() as s:
            rows = s.execute(select(CacheEntry.id, CacheEntry.size_bytes).order_by(*order).limit(limit))
            return [(int(i), int(b)) for i, b in rows]

    def iter_embeddings(self, batch: int = 5000) -> Iterator[tuple[str, int, np.ndarray]]:
        """(scope, id, vector) of every live entry that has an embedding, for rebuilding the index."""
        last = 0
        now = self.clock()
        while True:
            with self.session() as s:
                rows = s.execute(
                    select(CacheEntry.scope, CacheEntry.id, CacheEntry.embedding)
                    .where(
                        CacheEntry.id > last, CacheEntry.embedding.is_not(None), CacheEntry.expires_at > now
                    )
                    .where(CacheEntry.bad.is_(False))
                    .order_by(CacheEntry.id)
                    .limit(batch)
                ).all()
            if not rows:
                return
            for scope, entry_id, blob in rows:
                yield scope, entry_id, np.frombuffer(blob, dtype=np.float32)
            last = rows[-1][1]

    def exact_keys(self) -> Iterator[tuple[str, int]]:
        """(exact key, id) of every live entry, oldest first, streamed: to mirror the exact tier in
        memory (a bounded mirror keeps the newest)."""
        with self.session() as s:
            q = select(CacheEntry.exact_key, CacheEntry.id).where(
                CacheEntry.expires_at > self.clock(), CacheEntry.bad.is_(False)
            )
            for k, i in s.execute(q.order_by(CacheEntry.id).execution_options(yield_per=10_000)):
                yield k, int(i)

    def count_embeddings(self) -> int:
        with self.session() as s:
            return int(
                s.scalar(select(func.count(CacheEntry.id)).where(CacheEntry.embedding.is_not(None))) or 0
            )


def sql_stores(db: Store) -> CacheStores:
    """The cache's stores in ``db`` (what ``gateway/compose.py`` hands the response cache)."""
    replies = SqlReplies(db.session, db.clock)
    return CacheStores(SqlEntries(db.session, db.clock, replies), replies, SqlChanges(db.engine))
