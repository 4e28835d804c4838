"""Recently used cache entries kept in memory, so a hit needs no database query.

Entries change only through flags and learned thresholds, which update both the database and this
copy (``ResponseCache.flag_bad``, and ``ReplicaSync`` for what other replicas changed); the database
stays the source of truth.
"""

from __future__ import annotations

import asyncio

from cachegw.configtools.lru import Lru
from cachegw.gateway.storage.interfaces import EntryStore
from cachegw.gateway.storage.tables import CacheEntry

MEMO_ENTRIES = 10_000  # entries kept in memory


class EntryMemo:
    def __init__(self, entries: EntryStore, size: int = MEMO_ENTRIES) -> None:
        self.entries = entries
        self._entries: Lru[int, CacheEntry] = Lru(size)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    async def get(self, ids: list[int]) -> dict[int, CacheEntry]:
        """The entries of ``ids`` that exist, from memory or else from the database (off the loop), each
        made the most recently used (those in memory as they are read: loading the others never evicts
        them, unless more are found than the memo holds)."""
        found = {i: e for i in ids if (e := self._entries.get(i)) is not None}
        missing = [i for i in ids if i not in found]
        if missing:
            for entry_id, entry in (await asyncio.to_thread(self.entries.get_entries, missing)).items():
                self._entries[entry_id] = found[entry_id] = entry
        return found

    def remember(self, entry: CacheEntry) -> CacheEntry:
        """Keep an entry's copy: a new one as the most recently used (the least recently used one leaves
        when full), a kept one replaced, its recency as it was."""
        if not self._entries.replace(entry.id, entry):
            self._entries[entry.id] = entry
        return entry

    def refresh(self, entry: CacheEntry) -> None:
        """Replace the copy if one is kept (a change another replica made)."""
        self._entries.replace(entry.id, entry)

    def clear(self) -> None:
        """Drop every copy (the views are reloaded from the database)."""
        self._entries.clear()

    def forget(self, entry_id: int) -> None:
        self._entries.pop(entry_id, None)
