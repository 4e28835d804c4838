"""The exact tier: a repeat of the same canonical request, found by its exact key.

The keys are mirrored in memory (exact key -> entry ids), so an exact hit needs no query; a key
this replica does not know is still looked up in the database (another replica's answer, one that
replaced a known entry since the last sync, or one the mirror dropped). The mirror holds at most
``capacity`` keys (0: all), least recently used dropped first, so its memory stays flat however
many entries the database holds.
"""

from __future__ import annotations

import asyncio
import math

from cachegw.configtools.lru import Lru
from cachegw.gateway.cache.memo import EntryMemo
from cachegw.gateway.storage.interfaces import EntryStore
from cachegw.gateway.storage.tables import CacheEntry
from cachegw.policies.cache_keys import RequestKeys
from cachegw.policies.cacheability import Freshness, unservable


class ExactTier:
    def __init__(self, entries: EntryStore, memo: EntryMemo, capacity: int = 0) -> None:
        self.entries = entries
        self.memo = memo
        self.capacity = capacity
        self._ids, self._key_of = _mirrors(capacity)  # exact key -> entry ids; entry id -> exact key

    def __contains__(self, entry_id: int) -> bool:
        """Whether the mirror holds the entry (then it is counted in the cache's totals; with a bounded
        mirror the totals are also recounted from the database every minute)."""
        return entry_id in self._key_of

    def __len__(self) -> int:
        return len(self._ids)

    def rebuild(self) -> None:
        """Load the mirror from the database, the newest keys when bounded (on start, and on a reload
        while requests go on: the new mirror is built aside and swapped in whole)."""
        ids, key_of = _mirrors(self.capacity)
        for key, entry_id in self.entries.exact_keys():
            if entry_id not in key_of:
                _mirror(ids, key_of, key, entry_id)
        self._ids, self._key_of = ids, key_of

    def add(self, key: str, entry_id: int) -> None:
        _mirror(self._ids, self._key_of, key, entry_id)

    def drop(self, entry_id: int) -> None:
        key = self._key_of.pop(entry_id, None)
        held = self._ids.peek(key) if key is not None else None  # a drop is not a use
        if key is not None and held is not None and entry_id in held:
            held.remove(entry_id)
            if not held:
                del self._ids[key]

    async def find(
        self, tenant: str, model: str, keys: RequestKeys, now: float, fresh: Freshness
    ) -> CacheEntry | None:
        """The newest stored answer to exactly this request that may serve it, or None."""
        known = self._ids.get(keys.exact)  # made recently used
        found = await self.memo.get(list(known)) if known else {}
        if found:
            candidates = sorted(found.values(), key=lambda e: -e.id)
        else:  # unknown here, or replaced by another replica since the last sync
            candidates = await asyncio.to_thread(self.entries.find_exact, tenant, model, keys.exact, now)
            for entry in candidates:
                self.memo.remember(entry)
                self.add(entry.exact_key, entry.id)
        for entry in candidates:
            if (
                entry.tenant == tenant
                and entry.model == model
                and unservable(entry, keys.max_tokens, now, fresh) is None
            ):
                return entry
        return None


def _mirrors(capacity: int) -> tuple[Lru[str, list[int]], dict[int, str]]:
    """An empty mirror: exact key -> entry ids, at most ``capacity`` keys (0: all), least recently used
    first out, and entry id -> exact key, whose ids leave with their evicted key."""
    key_of: dict[int, str] = {}

    def evicted(key: str, gone: list[int]) -> None:
        for i in gone:
            key_of.pop(i, None)

    return Lru(capacity or math.inf, evicted), key_of


def _mirror(ids: Lru[str, list[int]], key_of: dict[int, str], key: str, entry_id: int) -> None:
    """Mirror ``entry_id`` under ``key`` as the most recently used (a new key past the mirror's capacity
    evicts the least recently used key and its entries)."""
    held = ids.setdefault(key, [])
    if entry_id not in held:
        held.append(entry_id)
        key_of[entry_id] = key
