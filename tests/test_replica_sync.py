"""Replicas on one database follow its change log: in-process response caches on a real PostgreSQL
(woken by NOTIFY, with the fallback poll set out of reach) and on one SQLite file (the poll alone).

Each replica is what ``gateway/compose.py`` builds: a ``ResponseCache`` with its own FAISS index, the
real MiniLM encoder, a ``Follower`` and, on PostgreSQL, its ``ChangeListener``. The tests wait on a
replica having read a given log row (``ReplicaSync.wait_read``), never on a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from sqlalchemy import func, select

from cachegw.embeddings.batcher import EmbeddingBatcher
from cachegw.embeddings.encoder import Encoder
from cachegw.embeddings.index import ScopedIndex
from cachegw.gateway.cache.error_control import ThresholdProvider
from cachegw.gateway.cache.follow import Follower
from cachegw.gateway.cache.response_cache import ResponseCache
from cachegw.gateway.config import load_settings
from cachegw.gateway.storage.changes import Change, ChangeKind, SqlChanges, log_changes
from cachegw.gateway.storage.evidence_store import EvidenceRow, EvidenceStore
from cachegw.gateway.storage.notify import ChangeListener
from cachegw.gateway.storage.request_record import CacheResult
from cachegw.gateway.storage.store import Store, sql_stores
from cachegw.gateway.storage.tables import CacheEntry, ChangeRow
from cachegw.policies.cache_keys import RequestKeys, request_keys
from cachegw.policies.cacheability import ANY_AGE
from tests.test_shared_store import fresh_database

NEVER_S = 3600.0  # the fallback poll, out of reach: on PostgreSQL only a notification syncs
WAIT_S = 60.0


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    enc = Encoder()
    enc.encode(["warm up"])
    return enc


def keys(text: str) -> RequestKeys:
    body = {"messages": [{"role": "user", "content": text}], "temperature": 0}
    return request_keys("t", "m", "chat", body)


def answer(text: str) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


@dataclass
class Replica:
    """One gateway's cache on the shared database, following the others."""

    db: Store
    cache: ResponseCache
    lines: ThresholdProvider
    follower: Follower
    listener: ChangeListener | None
    tasks: list[asyncio.Task] = field(default_factory=list)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.follower.run())]
        if self.listener is not None:
            self.tasks.append(asyncio.create_task(self.listener.run()))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.tasks = []

    async def caught_up(self, log_id: int) -> None:
        await asyncio.wait_for(self.cache.replicas.wait_read(log_id), WAIT_S)

    async def store(self, text: str) -> int:
        entry_id = await self.cache.insert("t", "m", "chat", keys(text), None, answer(text), 600)
        assert entry_id is not None
        return entry_id

    async def lookup(self, text: str) -> tuple[CacheResult, int | None]:
        found = await self.cache.lookup("t", "t", "m", keys(text), fresh=ANY_AGE)
        return found.result, (found.entry.id if found.entry is not None else None)

    def newest(self) -> int:
        return self.cache.replicas.changes.newest()


@contextlib.asynccontextmanager
async def replicas(url: str, n: int, encoder: Encoder, poll_s: float) -> AsyncIterator[list[Replica]]:
    config = load_settings(None).cache.updated({"verifier": False})
    batcher = EmbeddingBatcher(encoder, window_ms=0.0)  # type: ignore[arg-type]
    made: list[Replica] = []
    try:
        for _ in range(n):
            db = Store(url)
            lines = ThresholdProvider(EvidenceStore(db.session), time.time)
            cache = ResponseCache(config, sql_stores(db), ScopedIndex(encoder.dim, background=False),
                                  batcher, None, lines)  # fmt: skip
            await asyncio.to_thread(cache.rebuild_index, False)
            await asyncio.to_thread(lines.load)
            cache.replicas.follow(ChangeKind.EVIDENCE, lines)
            follower = Follower(cache.sync, poll_s)
            listener = ChangeListener(url, follower.wake) if url.startswith("postgresql") else None
            made.append(Replica(db, cache, lines, follower, listener))
            made[-1].start()
        yield made
    finally:
        for r in made:
            await r.stop()
            r.db.close()
        batcher.close()


def truth(db: Store) -> tuple[set[int], set[int], tuple[int, int]]:
    """What the database holds: live entry ids, the ids with a vector, (entries, bytes)."""
    entries = sql_stores(db).entries
    live = {i for _, i in entries.exact_keys()}
    vectors = {i for _, i, _ in entries.iter_embeddings()}
    return live, vectors, entries.totals()


def views(r: Replica) -> tuple[set[int], set[int], tuple[int, int]]:
    c = r.cache
    return set(c.exact._key_of), set(c.index._id_scope), (c.entries, c.bytes)  # type: ignore[attr-defined]


@pytest.fixture
def pg_url(postgres: str) -> str:
    return fresh_database(postgres)


async def test_a_store_and_a_flag_reach_every_replica_when_notified(pg_url, encoder) -> None:
    """(a) what one stores is an exact and a semantic hit on the other two once they read its row;
    (b) what one flags, the others refuse on their next request after they read the flag, though
    they had just served it from memory."""
    async with replicas(pg_url, 3, encoder, NEVER_S) as (a, b, c):
        entry_id = await a.store("How do I renew my passport?")
        row = a.newest()
        for other in (b, c):
            await other.caught_up(row)
            assert entry_id in other.cache.exact and entry_id in other.cache.index
            assert await other.lookup("How do I renew my passport?") == (CacheResult.EXACT_HIT, entry_id)
            assert await other.lookup("How can I renew my passport?") == (CacheResult.SEMANTIC_HIT, entry_id)
            assert (other.cache.entries, other.cache.bytes) == (a.cache.entries, a.cache.bytes)
        flagged = await a.cache.flag_bad(entry_id, None, whole_entry=True)
        assert flagged is not None
        row = a.newest()
        for other in (b, c):
            await other.caught_up(row)
            assert (await other.lookup("How do I renew my passport?"))[0] is CacheResult.MISS
            assert (await other.lookup("How can I renew my passport?"))[0] is CacheResult.MISS
            assert entry_id not in other.cache.index


async def test_false_hit_evidence_reaches_every_replica_once(pg_url, encoder) -> None:
    """An audit recorded on one replica is counted by the others as soon as they read its log row,
    and once on its own replica (where it comes back through the log)."""
    async with replicas(pg_url, 3, encoder, NEVER_S) as (a, b, c):
        row = EvidenceRow("m", "t", 0.93, False, "hit", time.time())
        await a.lines.record([row, replace(row, score=0.97, right=True)])
        newest = a.newest()
        for r in (a, b, c):
            await r.caught_up(newest)
            ev = r.lines.evidence[("m", "t")]
            assert (ev.total, sum(ev.wrong)) == (2, 1)


async def test_a_transaction_that_commits_late_is_not_lost(pg_url, encoder) -> None:
    """(c) transaction A takes the lower log id, B takes the next and commits first; a replica syncs
    between the two commits and after A's: it sees B's entry, then A's (an id cursor would skip A)."""
    async with replicas(pg_url, 2, encoder, NEVER_S) as (writer, reader):
        await reader.stop()  # synced by hand below
        late = keys("What is the capital of France?")
        vec = encoder.encode([late.query])[0]
        now = time.time()
        late_entry = CacheEntry(tenant="t", model="m", endpoint="chat", scope=late.scope,
                                exact_key=late.exact, query_text=late.query, embedding=vec.tobytes(),
                                response="{}", finish_reason="stop", size_bytes=2, created_at=now,
                                expires_at=now + 600)  # fmt: skip
        with writer.db.session() as s:  # A: open, holding its log row
            s.begin()
            s.add(late_entry)
            s.flush()
            log_changes(s, [Change(ChangeKind.STORE, late_entry.id)])
            a_row = s.scalar(select(func.max(ChangeRow.id)))  # its own row, seen only by A
            b_id = await writer.store("What is the tallest mountain?")  # B: commits
            b_row = writer.newest()
            assert a_row is not None and b_row > a_row
            await reader.cache.sync()
            assert b_id in reader.cache.exact and late_entry.id not in reader.cache.exact
            assert b_row in reader.cache.replicas._read
            s.commit()
        assert await reader.cache.sync() == 1  # A's entry, and B's not again
        assert late_entry.id in reader.cache.exact and late_entry.id in reader.cache.index
        assert await reader.lookup("What's the capital of France?") == (
            CacheResult.SEMANTIC_HIT,
            late_entry.id,
        )


def test_the_cursor_skips_nothing_and_repeats_nothing(pg_url) -> None:
    """The same, on the change feed alone: rows of a transaction still open are read once it commits,
    rows already read are not returned again."""
    db = Store(pg_url)
    changes = SqlChanges(db.engine)
    try:
        cursor = changes.start()
        with db.engine.connect() as open_tx:
            open_tx.begin()
            log_changes(open_tx, [Change(ChangeKind.STORE, 1)])
            with db.engine.begin() as conn:
                log_changes(conn, [Change(ChangeKind.STORE, 2)])
            first = changes.read(cursor)
            assert [c.entry_id for c in first.changes] == [2]
            again = changes.read(first.cursor)
            assert again.changes == []
            open_tx.commit()
        second = changes.read(again.cursor)
        assert [c.entry_id for c in second.changes] == [1]
        assert second.changes[0].id < first.changes[0].id  # committed later, with the lower id
        assert changes.read(second.cursor).changes == [] and not second.lost
    finally:
        db.close()


async def test_a_replica_cut_off_past_the_pruned_log_reloads(pg_url, encoder) -> None:
    """(d) a replica stops listening and syncing while the others store, flag and delete more than
    the pruned log keeps; when it comes back it reloads and holds exactly what the database holds."""
    async with replicas(pg_url, 3, encoder, NEVER_S) as (a, b, away):
        kept = await a.store("How do I reset my password?")
        doomed = await b.store("Why is the sky blue?")
        flagged = await a.store("Write a haiku about autumn leaves.")
        await away.caught_up(a.newest())
        assert {kept, doomed, flagged} <= views(away)[0]
        await away.stop()
        await b.cache.delete([doomed])
        await a.cache.flag_bad(flagged, None, whole_entry=True)
        fresh = [await a.store(q) for q in ("How long does a bank transfer take?", "Can I change my PIN?")]
        fresh.append(await b.store("Explain the difference between a list and a tuple in Python."))
        changes = a.cache.replicas.changes
        assert changes.prune(keep=2) > 0
        assert changes.read(away.cache.replicas.cursor).lost
        reloads = away.cache.replicas.reloads
        away.start()  # the listener connects and wakes the sync: the log is too short, so it reloads
        await away.caught_up(a.newest())
        assert away.cache.replicas.reloads == reloads + 1
        assert views(away) == truth(away.db)
        assert (await away.lookup("Why is the sky blue?"))[1] != doomed
        assert (await away.lookup("Write a haiku about autumn leaves."))[1] != flagged
        assert await away.lookup("How can I reset my password?") == (CacheResult.SEMANTIC_HIT, kept)
        assert await away.lookup("Can I change my PIN?") == (CacheResult.EXACT_HIT, fresh[1])
        # and it follows the log again from there
        late = await b.store("What is the boiling point of water?")
        await away.caught_up(b.newest())
        assert late in away.cache.exact and views(away) == truth(away.db)


async def test_two_replicas_on_one_sqlite_file_follow_by_polling(tmp_path: Path, encoder) -> None:
    """(e) SQLite has no notifications: the fallback poll brings a store, a flag and a delete across."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    async with replicas(url, 2, encoder, poll_s=0.05) as (a, b):
        entry_id = await a.store("How do I renew my passport?")
        other = await a.store("Why is the sky blue?")
        await b.caught_up(a.newest())
        assert await b.lookup("How can I renew my passport?") == (CacheResult.SEMANTIC_HIT, entry_id)
        await a.cache.flag_bad(entry_id, None, whole_entry=True)
        await a.cache.delete([other])
        await b.caught_up(a.newest())
        assert (await b.lookup("How do I renew my passport?"))[0] is CacheResult.MISS
        assert views(b) == truth(b.db) == views(a)
