"""Replica sync: what other gateways on the same database changed, applied to this one's views.

Entries they stored join the exact tier and the vector index, entries they flagged or re-thresholded
are re-read, entries they deleted are dropped, and the totals move by what they did.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from cachegw.gateway.cache.exact import ExactTier
from cachegw.gateway.cache.maintenance import Maintenance
from cachegw.gateway.cache.memo import EntryMemo
from cachegw.gateway.storage.interfaces import ChangeFeed, EntryStore, VectorIndex

SYNC_OVERLAP_S = 60.0  # how far back each sync looks again: late commits, replica clocks that differ


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
    ) -> None:
        self.entries, self.changes = entries, changes
        self.clock = entries.clock
        self.exact, self.memo, self.index = exact, memo, index
        self.maintenance = maintenance
        self.forget = forget
        self.synced_at = self.clock()  # of the last successful ``sync`` (a metric)

    async def sync(self) -> int:
        """Apply what other replicas did since the last call. Returns how many entries were added here
        or dropped.

        The window reaches ``SYNC_OVERLAP_S`` back, so a commit that landed late or a replica whose
        clock is behind is still seen; what is already known is skipped.
        """
        now = self.clock()
        changed, deleted = await asyncio.to_thread(
            self.changes.changes_since, self.synced_at - SYNC_OVERLAP_S
        )
        self.synced_at = now
        exact, memo, totals = self.exact, self.memo, self.maintenance.totals
        # counters move by what others did: their deletions of entries known here, their new entries
        gone = [i for i, _ in deleted if i in exact or i in self.index or i in memo]
        freed = {i: size for i, size in deleted if i in exact}
        wanted = [i for i, updated in changed if updated or i not in exact]
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
