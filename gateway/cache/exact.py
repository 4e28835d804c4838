"""The exact tier: a repeat of the same canonical request, found by its exact key.

The keys are mirrored in memory (exact key -> entry ids), so an exact hit needs no query; a key
this replica does not know is still looked up in the database (another replica's answer, or one
that replaced a known entry since the last sync).
"""

from __future__ import annotations

import asyncio

from cachegw.gateway.cache.memo import EntryMemo
from cachegw.gateway.storage.interfaces import EntryStore
from cachegw.gateway.storage.tables import CacheEntry
from cachegw.policies.cache_keys import RequestKeys
from cachegw.policies.cacheability import Freshness, unservable


class ExactTier:
    def __init__(self, entries: EntryStore, memo: EntryMemo) -> None:
        self.entries = entries
        self.memo = memo
        self._ids: dict[str, list[int]] = {}  # exact key -> entry ids
        self._key_of: dict[int, str] = {}

    def __contains__(self, entry_id: int) -> bool:
        """Whether this replica knows the entry (it is counted in the cache's totals)."""
        return entry_id in self._key_of

    def rebuild(self) -> None:
        """Load the mirror from the database (on start, and on a reload while requests go on: the new
        mirror is built aside and swapped in whole)."""
        ids: dict[str, list[int]] = {}
        key_of: dict[int, str] = {}
        for key, entry_id in self.entries.exact_keys():
            if entry_id not in key_of:
                ids.setdefault(key, []).append(entry_id)
                key_of[entry_id] = key
        self._ids, self._key_of = ids, key_of

    def add(self, key: str, entry_id: int) -> None:
        ids = self._ids.setdefault(key, [])
        if entry_id not in ids:
            ids.append(entry_id)
            self._key_of[entry_id] = key

    def drop(self, entry_id: int) -> None:
        key = self._key_of.pop(entry_id, None)
        if key is not None and entry_id in self._ids.get(key, []):
            self._ids[key].remove(entry_id)
            if not self._ids[key]:
                del self._ids[key]

    async def find(
        self, tenant: str, model: str, keys: RequestKeys, now: float, fresh: Freshness
    ) -> CacheEntry | None:
        """The newest stored answer to exactly this request that may serve it, or None."""
        known = self._ids.get(keys.exact)
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
