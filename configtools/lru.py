"""Bounded least-recently-used maps: cachetools' ``LRUCache`` and the little its users here need beside it.

cachetools counts entries (one per key), drops the least recently used first, and makes a key recently
used on every read (``lru[key]``, ``get``) and write. What it leaves out, each needed by some cache here:

- a size of 0 that keeps nothing (cachetools refuses every write then);
- a callback on each eviction, for state kept beside the map (a reverse index, links to undo);
- reads and a replacement that leave recency alone (a lookup that is not a use, a copy refreshed
  from another replica);
- a ``get`` that costs one lookup on a hit (cachetools' asks ``in`` first): the hot paths read here.

Like cachetools it is not thread-safe: a user shared by threads holds its own lock. Iteration follows
first insertion, not recency; ``items()`` and ``values()`` read through ``lru[key]`` and so make every
key recently used: ``peek_items()`` looks without touching.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar, overload

from cachetools import Cache, LRUCache

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
T = TypeVar("T")


class Lru(LRUCache[K, V]):
    """At most ``maxsize`` entries (``math.inf``: unbounded; 0: none), the least recently used evicted
    first; ``on_evict(key, value)`` runs for each one evicted to make room (not for ``del``/``pop``/
    ``clear``), and with ``maxsize`` 0 for each value written, as if it were kept and evicted at once."""

    def __init__(self, maxsize: float, on_evict: Callable[[K, V], None] | None = None) -> None:
        super().__init__(maxsize)
        self.on_evict = on_evict

    def __setitem__(self, key: K, value: V) -> None:
        if self.maxsize >= 1:
            super().__setitem__(key, value)
        elif self.on_evict is not None:
            self.on_evict(key, value)

    def popitem(self) -> tuple[K, V]:
        key, value = super().popitem()
        if self.on_evict is not None:
            self.on_evict(key, value)
        return key, value

    @overload
    def get(self, key: K, /) -> V | None: ...
    @overload
    def get(self, key: K, /, default: V | T) -> V | T: ...
    def get(self, key: K, /, default: V | T | None = None) -> V | T | None:
        """The value, made recently used; ``default`` when absent."""
        try:
            return self[key]
        except KeyError:
            return default

    def peek(self, key: K) -> V | None:
        """The value without making it recently used (None when absent)."""
        return Cache.__getitem__(self, key) if key in self else None

    def peek_items(self) -> Iterator[tuple[K, V]]:
        """Every (key, value), in first-insertion order, without making any recently used."""
        for key in self:
            yield key, Cache.__getitem__(self, key)

    def replace(self, key: K, value: V) -> bool:
        """Replace a kept value, its recency left as it is; False (nothing written) when not kept."""
        if key not in self:
            return False
        Cache.__setitem__(self, key, value)  # a known key: no eviction, no change of order
        return True
