"""Replica sync: what other gateways on the same database changed, applied to this one's views.

It reads the change log (``gateway/storage/changes.py``) from where it stands: entries others stored
join the exact tier and the vector index, entries they flagged or re-thresholded are re-read,
entries they deleted are dropped, and the totals move by what they did. The log's other rows (live
settings, false-hit evidence, learned templates) go to their ``LogFollower``. A replica that fell
behind the pruned log reloads every view from the tables. Its own changes come back through the log
too and are found already applied.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

import numpy as np

from cachegw.gateway.cache.exact import ExactTier
from cachegw.gateway.cache.maintenance import Maintenance
from cachegw.gateway.cache.memo import EntryMemo
from cachegw.gateway.storage.changes import ENTRY_KINDS, Change, ChangeKind, Cursor
from cachegw.gateway.storage.interfaces import ChangeFeed, EntryStore, VectorIndex

RECENT_IDS = 10_000  # log ids remembered as read, for ``wait_read``


class LogFollower(Protocol):
    """A view of this replica's that one kind of log row changes (``ReplicaSync.follow``)."""

    async def logged(self, ids: list[int]) -> object:
        """The rows the log named (their ids in their own table) were written: read them."""
        ...

    async def reload(self) -> object:
        """Rows may have been missed (the log was pruned past this replica): read everything again."""
        ...


class OnAnyChange:
    """A follower that reads its whole view again whenever the log names one of its rows (the live
    settings: one small table)."""

    def __init__(self, read: Callable[[], Awaitable[object]]) -> None:
        self.read = read

    async def logged(self, ids: list[int]) -> object:
        return await self.read()

    async def reload(self) -> object:
        return await self.read()


class ReplicaSync:
    def __init__(
        self,
        entries: EntryStore,
        changes: ChangeFeed,
        exact: ExactTier,
        memo: EntryMemo,
        index: VectorIndex,
        maintenance: Maintenance,
        forget: Callable[[list[int]], None],
        reload: Callable[[], object],
    ) -> None:
        """``reload`` loads every view from the tables (it calls ``restart`` first); it runs in a
        worker thread."""
        self.entries, self.changes = entries, changes
        self.exact, self.memo, self.index = exact, memo, index
        self.maintenance = maintenance
        self.forget, self.reload = forget, reload
        self.followers: dict[ChangeKind, LogFollower] = {}
        self.cursor = Cursor()
        self.synced_at = time.time()  # of the last successful ``sync`` (a metric)
        self.reloads = 0
        self._lock = asyncio.Lock()  # a notification and the fallback poll never sync at once
        self._read: deque[int] = deque(maxlen=RECENT_IDS)
        self._progress = asyncio.Condition()

    def follow(self, kind: ChangeKind, follower: LogFollower) -> None:
        """Hand the log's rows of ``kind`` (not an entry's) to ``follower``."""
        self.followers[kind] = follower

    def restart(self) -> None:
        """Follow the log from now on (before the views are loaded from the tables)."""
        self.cursor = self.changes.start()

    async def sync(self) -> int:
        """Apply what the log holds past this replica's cursor. Returns how many entries were added
        here or dropped (on a reload: how many entries the views now hold)."""
        async with self._lock:
            batch = await asyncio.to_thread(self.changes.read, self.cursor)
            if batch.lost:  # the cursor is taken first, then every view is read again
                await asyncio.to_thread(self.reload)
                await self.maintenance.recount()
                for follower in self.followers.values():
                    await follower.reload()
                self.reloads += 1
                done = self.maintenance.totals.entries
            else:
                done = await self._apply([c for c in batch.changes if c.kind in ENTRY_KINDS])
                self.cursor = batch.cursor
                for kind, follower in self.followers.items():
                    if named := [c for c in batch.changes if c.kind is kind]:
                        await follower.logged([c.entry_id for c in named if c.entry_id is not None])
            self.synced_at = time.time()
            self._read.extend(c.id for c in batch.changes)
        async with self._progress:
            self._progress.notify_all()
        return done

    async def wait_read(self, log_id: int) -> None:
        """Until this replica has read the log row ``log_id`` (or reloaded since it was written)."""
        reloads = self.reloads
        async with self._progress:
            await self._progress.wait_for(lambda: log_id in self._read or self.reloads > reloads)

    async def _apply(self, changes: list[Change]) -> int:
        exact, memo, totals = self.exact, self.memo, self.maintenance.totals
        deleted = [(c.entry_id, c.size_bytes) for c in changes if c.kind is ChangeKind.DELETE and c.entry_id]
        # counters move by what others did: their deletions of entries known here, their new entries
        gone = [i for i, _ in deleted if i in exact or i in self.index or i in memo]
        freed = {i: size for i, size in deleted if i in exact}
        stored = {c.entry_id for c in changes if c.kind is ChangeKind.STORE}
        updated = {c.entry_id for c in changes if c.kind is ChangeKind.UPDATE}
        wanted = sorted(i for i in (stored - {i for i, _ in deleted}) | updated if i is not None)
        wanted = [i for i in wanted if i in updated or i not in exact]
        fresh = await asyncio.to_thread(self.entries.get_entries, wanted) if wanted else {}
        added = 0
        for entry_id, entry in fresh.items():
            known = entry_id in exact
            if entry.bad:
                if known or entry_id in memo:
                    gone.append(entry_id)
                continue
            memo.refresh(entry)  # a learned threshold another replica set
            if not known:
                added += 1
                totals.entries += 1
                totals.bytes += entry.size_bytes
                exact.add(entry.exact_key, entry_id)
            if entry.embedding is not None and entry.scope and entry_id not in self.index:
                vec = np.frombuffer(entry.embedding, dtype=np.float32)[None]
                self.index.add(entry.scope, np.array([entry_id], dtype=np.int64), vec)
        self.forget(gone)
        totals.entries -= len(freed)
        totals.bytes -= sum(freed.values())
        return added + len(set(gone))
