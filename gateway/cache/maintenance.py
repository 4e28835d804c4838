"""Keeping the cache within its budgets: entry and byte totals, eviction, expiry, hit counting.

The totals are this replica's view of the database's (moved by its own inserts and deletions and by
``ReplicaSync``); ``expire`` recounts them now and then, since inserts racing on other replicas can
leave them a little off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from cachegw.gateway.config import CacheConfig
from cachegw.gateway.storage.interfaces import CacheStores

log = logging.getLogger("cachegw.gateway")

HIT_FLUSH_S = 1.0  # how often hit counts reach the database


@dataclass
class Totals:
    """Entries and bytes stored, as this replica counts them."""

    entries: int
    bytes: int

    def over(self, c: CacheConfig) -> bool:
        return self.entries > c.max_entries or self.bytes > c.max_bytes


class Maintenance:
    def __init__(
        self,
        settings: Callable[[], CacheConfig],
        stores: CacheStores,
        forget: Callable[[list[int]], None],
    ) -> None:
        """``forget`` drops deleted entries from every in-memory view."""
        self.settings = settings
        self.entries, self.replies, self.changes = stores.entries, stores.replies, stores.changes
        self.clock = self.entries.clock
        self.forget = forget
        self.totals = Totals(*self.entries.totals())
        self._evict_lock = asyncio.Lock()
        self._pending_hits: dict[int, tuple[int, float]] = {}

    def record_hit(self, entry_id: int) -> None:
        """Counted in memory; ``flush_hits`` writes the counts in one transaction."""
        n, _ = self._pending_hits.get(entry_id, (0, 0.0))
        self._pending_hits[entry_id] = (n + 1, self.clock())

    def drop_hits(self, ids: list[int]) -> None:
        """Uncounted hits of deleted entries are not written."""
        for i in ids:
            self._pending_hits.pop(i, None)

    async def flush_hits(self) -> None:
        hits, self._pending_hits = self._pending_hits, {}
        await asyncio.to_thread(self.entries.record_hits, hits)

    async def recount(self) -> None:
        """Read the totals from the database (in place: ``ReplicaSync`` holds the same object)."""
        self.totals.entries, self.totals.bytes = await asyncio.to_thread(self.entries.totals)

    async def delete(self, ids: list[int]) -> int:
        """Remove entries from the database first, then from the in-memory views."""
        removed = await asyncio.to_thread(self.entries.delete_entries, ids)
        self.forget(ids)
        await self.recount()
        return removed

    async def evict(self) -> int:
        """Bring the cache back under its entry and byte budgets (LRU or LFU), down to 95% of them."""
        async with self._evict_lock:
            c = self.settings()
            over_n = self.totals.entries - int(c.max_entries * 0.95)
            over_b = self.totals.bytes - int(c.max_bytes * 0.95)
            if over_n <= 0 and over_b <= 0:
                return 0
            order = await asyncio.to_thread(self.entries.eviction_order, c.eviction, max(over_n, 0) + 1000)
            victims: list[int] = []
            freed = 0
            for entry_id, size in order:
                if len(victims) >= over_n and freed >= over_b:
                    break
                victims.append(entry_id)
                freed += size
            removed = await self.delete(victims)
            log.info("evicted %d entries (%s)", removed, c.eviction)
            return removed

    async def expire(self) -> int:
        """Delete expired entries; also prunes the change log and old replies, and recounts the
        totals."""
        now = self.clock()
        await asyncio.to_thread(self.changes.prune, self.settings().change_log_rows)
        # a conversation that comes back later than any entry can live loses only a prefix-cache hit
        await asyncio.to_thread(self.replies.prune_replies, now - self.settings().max_ttl_seconds)
        ids = await asyncio.to_thread(self.entries.expired_ids, now)
        if ids:
            return await self.delete(ids)
        await self.recount()
        return 0
