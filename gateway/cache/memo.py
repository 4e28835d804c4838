"""Recently used cache entries kept in memory, so a hit needs no database query.

Entries change only through flags and learned thresholds, which update both the database and this
copy (``ResponseCache.flag_bad``, and ``ReplicaSync`` for what other replicas changed); the database
stays the source of truth.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from cachegw.gateway.storage.interfaces import EntryStore
from cachegw.gateway.storage.tables import CacheEntry

MEMO_ENTRIES = 10_000  # entries kept in memory


class EntryMemo:
    def __init__(self, entries: EntryStore, size: int = MEMO_ENTRIES) -> None:
        self.entries = entries
        self.size = size
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    async def get(self, ids: list[int]) -> dict[int, CacheEntry]:
        """The entries of ``ids`` that exist, from memory or else from the database (off the loop)."""
        found = {i: self._entries[i] for i in ids if i in self._entries}
        missing = [i for i in ids if i not in found]
        if missing:
            for entry_id, entry in (await asyncio.to_thread(self.entries.get_entries, missing)).items():
                found[entry_id] = self.remember(entry)
        for i in found:
            self._entries.move_to_end(i)
        return found

    def remember(self, entry: CacheEntry) -> CacheEntry:
        """Keep (or replace) an entry's copy; the least recently used one leaves when full."""
        self._entries[entry.id] = entry
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return entry

    def refresh(self, entry: CacheEntry) -> None:
        """Replace the copy if one is kept (a change another replica made)."""
        if entry.id in self._entries:
            self._entries[entry.id] = entry

    def clear(self) -> None:
        """Drop every copy (the views are reloaded from the database)."""
        self._entries = OrderedDict()

    def forget(self, entry_id: int) -> None:
        self._entries.pop(entry_id, None)
