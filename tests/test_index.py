"""ScopedIndex: hard scope isolation, exactness against numpy brute force, flat -> HNSW switch, tombstones."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cachegw.embeddings.index import ScopedIndex

DIM = 32


def unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def brute(ids: np.ndarray, vecs: np.ndarray, q: np.ndarray, k: int) -> list[int]:
    sims = vecs @ q
    return [int(ids[j]) for j in np.argsort(-sims, kind="stable")[:k]]


def small_index(**kw) -> ScopedIndex:
    kw.setdefault("hnsw_threshold", 10_000)
    return ScopedIndex(dim=DIM, background=False, ef_search=512, **kw)


def test_scope_is_a_hard_filter() -> None:
    rng = np.random.default_rng(0)
    idx = small_index()
    a = unit(rng, 50)
    idx.add("A", np.arange(50), a)
    twin = a[7] + 1e-4 * unit(rng, 1)[0]
    twin /= np.linalg.norm(twin)
    idx.add("B", np.array([1000]), twin[None, :].astype(np.float32))
    hits = idx.search("A", twin.astype(np.float32), k=50)
    assert 1000 not in [i for i, _ in hits] and hits[0][0] == 7
    assert idx.search("B", a[7], k=5) == [(1000, pytest.approx(float(a[7] @ twin), abs=1e-5))]
    assert idx.search("C", a[7]) == []


@pytest.mark.parametrize("threshold", [10_000, 40])
def test_add_remove_search_match_brute_force(threshold: int) -> None:
    rng = np.random.default_rng(1)
    idx = small_index(hnsw_threshold=threshold)
    vecs, ids = unit(rng, 300), np.arange(10, 310, dtype=np.int64)
    for start in range(0, 300, 100):
        idx.add("s", ids[start : start + 100], vecs[start : start + 100])
    gone = set(rng.choice(ids, 40, replace=False).tolist())
    assert idx.remove(list(gone) + [99_999]) == 40
    keep = np.array([i not in gone for i in ids])
    queries = unit(rng, 25)
    for q in queries:
        got = idx.search("s", q, k=5)
        assert [i for i, _ in got] == brute(ids[keep], vecs[keep], q, 5)
        assert [s for _, s in got] == pytest.approx(
            sorted((vecs[keep] @ q).tolist(), reverse=True)[:5], abs=1e-5
        )
    for got, q in zip(idx.search_batch(["s"] * len(queries), queries, k=5), queries, strict=True):
        one = idx.search("s", q, k=5)
        assert [i for i, _ in got] == [i for i, _ in one]
        assert [s for _, s in got] == pytest.approx([s for _, s in one], abs=1e-5)
    assert len(idx) == idx.scope_size("s") == 260
    assert idx.scope_kind("s") == ("hnsw" if threshold == 40 else "flat")


def test_flat_to_hnsw_switch_keeps_results() -> None:
    rng = np.random.default_rng(2)
    idx = small_index(hnsw_threshold=150)
    vecs = unit(rng, 200)
    idx.add("s", np.arange(100), vecs[:100])
    queries = unit(rng, 20)
    for q in queries:
        assert [i for i, _ in idx.search("s", q, k=3)] == brute(np.arange(100), vecs[:100], q, 3)
    assert idx.scope_kind("s") == "flat"
    idx.add("s", np.arange(100, 200), vecs[100:])
    assert idx.scope_kind("s") == "hnsw" and idx.scope_size("s") == 200
    for q in queries:
        assert [i for i, _ in idx.search("s", q, k=3)] == brute(np.arange(200), vecs, q, 3)


def test_tombstones_filtered_then_compacted() -> None:
    rng = np.random.default_rng(3)
    idx = small_index(hnsw_threshold=50, tombstone_ratio=0.2)
    vecs = unit(rng, 100)
    idx.add("s", np.arange(100), vecs)
    assert idx.scope_kind("s") == "hnsw"
    idx.remove(range(10))  # 10%: kept as tombstones
    assert idx.stats()["tombstones"] == 10
    for j in range(10):
        hits = idx.search("s", vecs[j], k=100)
        assert len(hits) == 90 and all(i >= 10 for i, _ in hits)
    idx.remove(range(10, 25))  # 25% > 20%: compaction rebuilds the scope without them
    assert idx.stats()["tombstones"] == 0 and idx.scope_size("s") == 75
    assert idx.search("s", vecs[30])[0][0] == 30
    assert {i for i, _ in idx.search("s", vecs[0], k=100)} == set(range(25, 100))


def test_rebuild_journal_replays_concurrent_changes() -> None:
    """Adds/removes that land while a scope is being rebuilt (outside the lock) must survive the swap."""
    rng = np.random.default_rng(4)
    idx = small_index(hnsw_threshold=60)
    vecs = unit(rng, 80)
    idx.add("s", np.arange(50), vecs[:50])
    started, release = threading.Event(), threading.Event()
    build = idx._build

    def slow_build(*args, **kw):
        started.set()
        release.wait(5)
        return build(*args, **kw)

    idx._build = slow_build  # type: ignore[method-assign]
    worker = threading.Thread(target=idx.compact, args=("s",))
    worker.start()
    assert started.wait(5)
    idx.add("s", np.arange(50, 80), vecs[50:])  # served by the old index meanwhile
    idx.remove([0, 60])
    assert idx.search("s", vecs[70])[0][0] == 70
    release.set()
    worker.join(5)
    assert idx.scope_size("s") == 78
    assert idx.search("s", vecs[70])[0][0] == 70 and idx.search("s", vecs[0])[0][0] != 0
    assert all(i not in (0, 60) for i, _ in idx.search("s", vecs[0], k=80))


def test_rebuild_from_items_and_stats() -> None:
    rng = np.random.default_rng(5)
    idx = small_index(hnsw_threshold=100)
    idx.add("old", np.array([5]), unit(rng, 1))
    vecs = unit(rng, 160)
    items = [("big" if j < 120 else "small", j, vecs[j]) for j in range(160)]
    idx.rebuild(iter(items), total=len(items), progress=False)
    assert len(idx) == 160 and idx.scope_size("old") == 0
    assert idx.scope_kind("big") == "hnsw" and idx.scope_kind("small") == "flat"
    assert idx.search("big", vecs[3])[0][0] == 3 and idx.search("small", vecs[150])[0][0] == 150
    assert idx.search("small", vecs[3], k=3)[0][0] >= 120
    res = idx.search_batch(["small", "big", "nope"], vecs[[150, 3, 4]], k=1)
    assert [r[0][0] if r else None for r in res] == [150, 3, None]
    stats = idx.stats()
    assert stats["entries"] == 160 and stats["scopes"] == 2 and stats["hnsw_scopes"] == 1
    assert stats["bytes"] > 160 * DIM * 4
    idx.clear()
    assert len(idx) == 0 and idx.search("big", vecs[3]) == []


def test_default_dim_and_background_switch() -> None:
    rng = np.random.default_rng(6)
    idx = ScopedIndex(hnsw_threshold=64)
    vecs = unit(rng, 100, 384)
    idx.add("s", np.arange(100), vecs)
    idx.wait_maintenance(10)
    assert idx.scope_kind("s") == "hnsw"
    assert idx.search("s", vecs[42], k=1)[0][0] == 42


def test_bad_inputs_raise_clear_errors() -> None:
    rng = np.random.default_rng(7)
    idx = small_index()
    good = unit(rng, 2)
    idx.add("s", np.array([1, 2]), good)
    cases = [
        (lambda: idx.add("s", np.array([3, 4]), good.astype(np.float64)), "float32"),
        (lambda: idx.add("s", np.array([3, 4]), unit(rng, 2, DIM + 1)), "shape"),
        (lambda: idx.add("s", np.array([3, 4]), good * 2), "normalised"),
        (lambda: idx.add("s", np.array([3, 4]), np.full((2, DIM), np.nan, np.float32)), "NaN"),
        (lambda: idx.add("s", np.array([3]), good), "1-D array of 2"),
        (lambda: idx.add("s", np.array([3, 3]), good), "duplicates"),
        (lambda: idx.add("s", np.array([-1, 3]), good), "non-negative"),
        (lambda: idx.add("s", np.array([1.0, 3.0]), good), "integers"),
        (lambda: idx.add("t", np.array([2, 3]), good), "already present"),
        (lambda: idx.add("", np.array([3, 4]), good), "scope"),
        (lambda: idx.search("s", good[0], k=0), "k must"),
        (lambda: idx.search("s", good[0].tolist()), "numpy"),
        (lambda: idx.search_batch(["s"], good), "2 query vectors"),
        (lambda: idx.rebuild([("s", 1, good[0].astype(np.float64))], progress=False), "float32"),
        (lambda: idx.rebuild([("s", 1, good[0]), ("s", 1, good[1])], progress=False), "duplicates"),
        (lambda: idx.rebuild([("s", 1, good[0]), ("t", 1, good[1])], progress=False), "two scopes"),
        (lambda: ScopedIndex(tombstone_ratio=1.5), "tombstone_ratio"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()
    assert len(idx) == 2 and idx.search("s", good[1])[0][0] == 2
