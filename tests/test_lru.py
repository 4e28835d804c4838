"""The one bounded least-recently-used map (configtools/lru.py): cachetools' LRUCache plus a size of 0
that keeps nothing, a callback on each eviction, and a read and a replacement that leave recency alone."""

from __future__ import annotations

import math

import pytest

from cachegw.configtools.lru import Lru


def test_the_least_recently_used_leaves_first_and_reads_make_recent() -> None:
    lru: Lru[str, int] = Lru(2)
    lru["a"] = 1
    lru["b"] = 2
    assert lru.get("a") == 1  # "b" is now the least recently used
    lru["c"] = 3
    assert lru.get("b") is None and lru.get("a") == 1 and lru.get("c") == 3 and len(lru) == 2
    assert lru["a"] == 1  # "c" is now the least recently used
    lru["c"] = 30  # a write makes recent too
    lru["d"] = 4
    assert "a" not in lru and lru.get("c") == 30 and lru.get("missing", -1) == -1
    with pytest.raises(KeyError):
        lru["a"]


def test_zero_keeps_nothing_and_inf_keeps_all() -> None:
    off: Lru[str, int] = Lru(0)
    off["a"] = 1
    assert off.get("a") is None and len(off) == 0
    every: Lru[int, int] = Lru(math.inf)
    for i in range(10_000):
        every[i] = i
    assert len(every) == 10_000 and every.get(0) == 0


def test_each_eviction_is_told_and_nothing_else() -> None:
    gone: list[tuple[str, int]] = []
    lru: Lru[str, int] = Lru(2, lambda k, v: gone.append((k, v)))
    lru["a"], lru["b"] = 1, 2
    lru["a"] = 10  # a known key: nothing evicted
    lru["c"] = 3
    assert gone == [("b", 2)]
    del lru["a"]
    assert lru.pop("c") == 3 and lru.pop("x", None) is None
    lru["d"] = 4
    lru.clear()
    assert gone == [("b", 2)] and len(lru) == 0  # del, pop and clear are not evictions
    off: Lru[str, int] = Lru(0, lambda k, v: gone.append((k, v)))
    off["z"] = 9  # kept and evicted at once
    assert gone == [("b", 2), ("z", 9)] and "z" not in off


def test_peek_and_replace_leave_recency_alone() -> None:
    gone: list[str] = []
    lru: Lru[str, int] = Lru(2, lambda k, _: gone.append(k))
    lru["a"], lru["b"] = 1, 2
    assert lru.peek("a") == 1 and lru.peek("x") is None
    assert lru.replace("a", 11) and not lru.replace("x", 0)
    assert "x" not in lru and lru.peek("a") == 11
    lru["c"] = 3  # "a" is still the least recently used
    assert gone == ["a"] and lru.peek("b") == 2
    assert lru.setdefault("b", 0) == 2  # a read: "c" is now the oldest
    assert dict(lru.peek_items()) == {"b": 2, "c": 3}  # and still is
    lru["d"] = 4
    assert gone == ["a", "c"]
    assert lru.get("b") == 2  # "d" is the oldest, and stays so through peek_items
    assert list(lru.peek_items()) == [("b", 2), ("d", 4)]  # first insertion's order, not recency's
    lru["e"] = 5
    assert gone == ["a", "c", "d"] and lru.get("b") == 2  # "e" is the oldest
    assert dict(lru.items()) == {"b": 2, "e": 5}  # items() reads each in insertion order: "e" is newest
    lru["f"] = 6
    assert gone == ["a", "c", "d", "b"]
