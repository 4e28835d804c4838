"""Scoped cosine nearest-neighbour search over L2-normalised embeddings.

A scope (hash of tenant + model + context) is a hard filter, so each scope has its own index: a query can
only ever see its own scope's vectors, and a small tenant never pays for a big one's size. Small scopes use
exact search on a numpy matrix (one BLAS matvec: several times faster than faiss IndexFlatIP for a single
query here, and O(1) deletes). A scope that grows past ``hnsw_threshold`` is rebuilt as FAISS HNSW
(IndexHNSWFlat, inner product), which stays under a millisecond at 1M entries where exact search takes
~100 ms. HNSW cannot delete: removed ids become tombstones excluded by an IDSelector during the search (so
k results still come back), and the scope is compacted once tombstones pass ``tombstone_ratio``. Rebuilds
run outside the lock on a snapshot while the old index keeps serving; adds and removes made meanwhile are
journaled and replayed onto the new index before it is swapped in. With a ``snapshot_dir`` each HNSW scope is
saved after it is built and on shutdown, and a restart reads it back (embeddings/snapshot.py) instead of
spending minutes rebuilding the graph.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from tqdm import tqdm

from cachegw.embeddings import snapshot
from cachegw.embeddings.flat_index import FlatIndex
from cachegw.embeddings.index_inputs import check_ids, check_scope, check_vecs

log = logging.getLogger(__name__)

DEFAULT_DIM = 384
# Chosen with bench/faiss_lookup.py on real MiniLM embeddings (results in bench/results/faiss_lookup.json):
# exact numpy search is ~0.1 ms at 10k, ~0.7 ms at 20k, ~2.3 ms at 50k; HNSW stays ~0.15-0.3 ms.
HNSW_THRESHOLD = 20_000
HNSW_M = 32
EF_CONSTRUCTION = 80  # at 100k: build 17 s (40: 10 s, 160: 32 s); recall gains of 160 were within noise
EF_SEARCH = 64  # at 1M: paraphrase recall@1 0.998, hard negatives 0.974, p50 0.23 ms (docs/benchmarks.md)
TOMBSTONE_RATIO = 0.2
_BUILD_CHUNK = 20_000  # rows per HNSW add call: keeps progress visible and OpenMP busy

Result = list[tuple[int, float]]


@dataclass
class _Scope:
    """One scope's index; ``journal`` is not None while a rebuild of this scope is in flight."""

    index: Any  # FlatIndex, or faiss.IndexIDMap over ``inner``
    inner: Any = None  # the faiss.IndexHNSWFlat (for reconstruct and graph stats); None when flat
    tombstones: set[int] = field(default_factory=set)
    params: Any = None  # cached (faiss.SearchParametersHNSW, the selectors it points to)
    journal: list[tuple[str, np.ndarray, np.ndarray | None]] | None = None
    dirty: bool = False  # changed since its snapshot was written (or never written)

    @property
    def hnsw(self) -> bool:
        return self.inner is not None

    @property
    def live(self) -> int:
        return int(self.index.ntotal) - len(self.tombstones)


class ScopedIndex:
    """Thread-safe id -> vector store with per-scope nearest-neighbour search (cosine on unit vectors)."""

    def __init__(
        self,
        dim: int = DEFAULT_DIM,
        hnsw_threshold: int = HNSW_THRESHOLD,
        hnsw_m: int = HNSW_M,
        ef_construction: int = EF_CONSTRUCTION,
        ef_search: int = EF_SEARCH,
        tombstone_ratio: float = TOMBSTONE_RATIO,
        background: bool = True,
        snapshot_dir: Path | None = None,
    ) -> None:
        if min(dim, hnsw_threshold, hnsw_m, ef_construction, ef_search) <= 0:
            raise ValueError("dim, hnsw_threshold, hnsw_m, ef_construction and ef_search must be positive")
        if not 0.0 < tombstone_ratio < 1.0:
            raise ValueError(f"tombstone_ratio must be in (0, 1), got {tombstone_ratio}")
        self.dim, self.hnsw_threshold, self.hnsw_m = dim, hnsw_threshold, hnsw_m
        self.ef_construction, self.ef_search = ef_construction, ef_search
        self.tombstone_ratio = tombstone_ratio
        self.background = background  # False: switches and compactions run in the calling thread
        self.snapshot_dir = snapshot_dir  # HNSW scopes saved here (embeddings/snapshot.py); None: never
        self._lock = threading.RLock()
        self._scopes: dict[str, _Scope] = {}
        self._id_scope: dict[int, str] = {}
        self._workers: list[threading.Thread] = []

    def add(self, scope: str, ids: np.ndarray, vecs: np.ndarray) -> None:
        """Insert vectors under globally unique ids; the scope is created on first use."""
        check_scope(scope)
        vecs = check_vecs(vecs, self.dim)
        ids = check_ids(ids, vecs.shape[0])
        if not len(ids):
            return
        with self._lock:
            taken = [i for i in ids.tolist() if i in self._id_scope]
            if taken:
                raise ValueError(f"ids already present: {taken[:5]}{'...' if len(taken) > 5 else ''}")
            entry = self._scopes.get(scope) or self._scopes.setdefault(scope, _Scope(FlatIndex(self.dim)))
            entry.index.add_with_ids(vecs, ids)
            entry.dirty = True
            self._id_scope.update(dict.fromkeys(ids.tolist(), scope))
            if entry.journal is not None:
                entry.journal.append(("add", ids.copy(), vecs.copy()))
            switch = not entry.hnsw and entry.journal is None and entry.live >= self.hnsw_threshold
        if switch:
            self._schedule(scope)

    def remove(self, ids: Iterable[int]) -> int:
        """Delete ids wherever they are; unknown ids are ignored. Returns how many were removed."""
        by_scope: dict[str, list[int]] = {}
        compact: list[str] = []
        with self._lock:
            for i in ids:
                name = self._id_scope.pop(int(i), None)
                if name is not None:
                    by_scope.setdefault(name, []).append(int(i))
            for name, gone in by_scope.items():
                entry, arr = self._scopes[name], np.asarray(gone, dtype=np.int64)
                self._drop(entry, arr)
                if entry.journal is not None:
                    entry.journal.append(("remove", arr, None))
                elif entry.live == 0:
                    del self._scopes[name]
                elif len(entry.tombstones) > self.tombstone_ratio * int(entry.index.ntotal):
                    compact.append(name)
        for name in compact:
            self._schedule(name)
        return sum(len(v) for v in by_scope.values())

    @staticmethod
    def _drop(entry: _Scope, ids: np.ndarray) -> None:
        entry.dirty = True
        if entry.hnsw:
            entry.tombstones.update(ids.tolist())
            entry.params = None
        else:
            entry.index.remove(ids)

    def clear(self) -> None:
        """Forget everything (a rebuild in flight is discarded when it finishes)."""
        with self._lock:
            self._scopes, self._id_scope = {}, {}

    def search(self, scope: str, vec: np.ndarray, k: int = 1) -> Result:
        """Up to ``k`` (id, cosine) pairs of ``scope``, best first; [] for an unknown or empty scope."""
        if isinstance(vec, np.ndarray) and vec.ndim == 1:
            vec = vec[None, :]
        return self.search_batch([scope], vec, k)[0]

    def search_batch(self, scopes: Sequence[str], vecs: np.ndarray, k: int = 1) -> list[Result]:
        """One result list per query row; rows are grouped so each scope is searched once."""
        vecs = check_vecs(vecs, self.dim, "query vectors")
        if len(scopes) != vecs.shape[0]:
            raise ValueError(f"got {len(scopes)} scopes for {vecs.shape[0]} query vectors")
        if not isinstance(k, int | np.integer) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        rows: dict[str, list[int]] = {}
        for row, scope in enumerate(scopes):
            rows.setdefault(check_scope(scope), []).append(row)
        out: list[Result] = [[] for _ in scopes]
        with self._lock:
            for scope, idx in rows.items():
                entry = self._scopes.get(scope)
                if entry is None or entry.live == 0:
                    continue
                dist, lab = entry.index.search(vecs[idx], min(int(k), entry.live), params=self._params(entry))
                for row, d_row, l_row in zip(idx, dist, lab, strict=True):
                    out[row] = [(int(i), float(d)) for i, d in zip(l_row, d_row, strict=True) if i >= 0]
        return out

    def _params(self, entry: _Scope) -> Any:
        """HNSW search parameters with the tombstone filter, cached until the tombstones change."""
        if not entry.hnsw:
            return None
        if entry.params is None:
            params, keep = faiss.SearchParametersHNSW(efSearch=self.ef_search), []
            if entry.tombstones:
                keep = [faiss.IDSelectorBatch(np.fromiter(entry.tombstones, np.int64, len(entry.tombstones)))]
                keep.append(faiss.IDSelectorNot(keep[0]))
                params.sel = keep[1]
            entry.params = (params, keep)  # faiss holds raw pointers: keep the selectors alive with it
        return entry.params[0]

    def _build(self, ids: np.ndarray, vecs: np.ndarray, hnsw: bool, bar: tqdm | None = None) -> _Scope:
        """A scope's index from scratch; called without the lock held (this is the slow part)."""
        if hnsw:
            inner = faiss.IndexHNSWFlat(self.dim, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            inner.hnsw.efConstruction, inner.hnsw.efSearch = self.ef_construction, self.ef_search
            scope = _Scope(faiss.IndexIDMap(inner), inner)
        else:
            scope = _Scope(FlatIndex(self.dim))
        for start in range(0, len(ids), _BUILD_CHUNK):
            scope.index.add_with_ids(vecs[start : start + _BUILD_CHUNK], ids[start : start + _BUILD_CHUNK])
            if bar is not None:
                bar.update(min(len(ids) - start, _BUILD_CHUNK))
        return scope

    def _wants_hnsw(self, n: int, was_hnsw: bool) -> bool:
        """Hysteresis: a compacted HNSW scope only falls back to flat well below the threshold."""
        return n >= (self.hnsw_threshold // 2 if was_hnsw else self.hnsw_threshold)

    @staticmethod
    def _entries(scope: _Scope) -> tuple[np.ndarray, np.ndarray]:
        """Copy of the live (id, vector) pairs, read back from the index: vectors are stored only once."""
        if not scope.hnsw:
            return scope.index.entries()
        ids = faiss.vector_to_array(scope.index.id_map).astype(np.int64)
        vecs = (
            scope.inner.reconstruct_n(0, len(ids)) if len(ids) else np.zeros((0, scope.index.d), np.float32)
        )
        if scope.tombstones:
            keep = ~np.isin(ids, np.fromiter(scope.tombstones, np.int64, len(scope.tombstones)))
            ids, vecs = ids[keep], vecs[keep]
        return ids, np.ascontiguousarray(vecs, dtype=np.float32)

    def _schedule(self, name: str) -> None:
        if not self.background:
            self.compact(name)
            return
        worker = threading.Thread(target=self.compact, args=(name,), name=f"rebuild-{name}", daemon=True)
        with self._lock:
            self._workers = [w for w in self._workers if w.is_alive()] + [worker]
        worker.start()

    def wait_maintenance(self, timeout: float | None = None) -> None:
        """Join background rebuilds (tests, benchmarks, orderly shutdown)."""
        with self._lock:
            workers = list(self._workers)
        for w in workers:
            w.join(timeout)

    def compact(self, scope: str) -> bool:
        """Rebuild a scope without tombstones, as HNSW or flat by size; searches are served meanwhile."""
        with self._lock:
            old = self._scopes.get(scope)
            if old is None or old.journal is not None:
                return False
            ids, vecs = self._entries(old)
            old.journal = []
        try:
            new = self._build(ids, vecs, self._wants_hnsw(len(ids), old.hnsw))
            self._save(scope, new)  # still private here; the journal replayed below is reconciled on load
        except Exception:
            log.exception("rebuild of scope %s failed; keeping the old index", scope)
            with self._lock:
                old.journal = None
            return False
        with self._lock:
            if self._scopes.get(scope) is not old:  # cleared or replaced by rebuild() meanwhile
                return False
            for op, op_ids, op_vecs in old.journal:
                if op == "add":
                    new.index.add_with_ids(op_vecs, op_ids)
                else:
                    self._drop(new, op_ids)
            new.dirty = new.dirty or bool(old.journal)
            self._scopes[scope] = new
            if new.live == 0:
                del self._scopes[scope]
        log.info("rebuilt scope %s: %d entries, %s", scope, new.live, "hnsw" if new.hnsw else "flat")
        return True

    def rebuild(
        self, items: Iterable[tuple[str, int, np.ndarray]], total: int | None = None, progress: bool = True
    ) -> None:
        """Replace the whole content with ``(scope, id, vector)`` rows (from the database on start-up).

        Rows are staged per scope in contiguous arrays, then each scope is built once at its final size,
        which is much faster than growing through the flat -> HNSW switch; flat scopes keep the staging array.
        """
        progress = progress and not os.environ.get("TQDM_DISABLE")  # tqdm's own switch (JSON logs set it)
        staged: dict[str, FlatIndex] = {}
        for scope, i, vec in tqdm(
            items, total=total, disable=not progress, file=sys.stderr, desc="index load"
        ):
            flat = staged.get(scope) or staged.setdefault(check_scope(scope), FlatIndex(self.dim))
            flat.append(i, vec)
        scopes: dict[str, _Scope] = {}
        id_scope: dict[int, str] = {}
        count = sum(f.ntotal for f in staged.values())
        with tqdm(total=count, disable=not progress, file=sys.stderr, desc="index build") as bar:
            for name in list(staged):
                flat = staged.pop(name)  # dropped as soon as it is indexed, to bound peak memory
                ids = check_ids(flat.ids[: flat.ntotal], flat.ntotal)
                vecs = check_vecs(flat.vecs[: flat.ntotal], self.dim, f"vectors of scope {name!r}")
                for i in ids.tolist():
                    if id_scope.setdefault(i, name) is not name:
                        raise ValueError(f"id {i} appears in two scopes")
                if self._wants_hnsw(len(ids), False):
                    scopes[name] = self._restore_or_build(name, ids, vecs, bar)
                else:
                    scopes[name] = _Scope(flat)
                    bar.update(len(ids))
        if self.snapshot_dir is not None:
            snapshot.remove_except(self.snapshot_dir, {n for n, e in scopes.items() if e.hnsw})
        with self._lock:
            self._scopes, self._id_scope = scopes, id_scope

    def _restore_or_build(self, name: str, ids: np.ndarray, vecs: np.ndarray, bar: tqdm) -> _Scope:
        """An HNSW scope from its snapshot when one is usable, else built (and then saved)."""
        if self.snapshot_dir is not None:
            got = snapshot.restore(self.snapshot_dir, name, ids, vecs, self.hnsw_m, self.tombstone_ratio)
            if got is not None:
                got.inner.hnsw.efConstruction, got.inner.hnsw.efSearch = self.ef_construction, self.ef_search
                bar.update(len(ids))
                log.info(
                    "scope %s read from its snapshot: %d entries, %d added, %d tombstoned",
                    name,
                    len(ids),
                    got.added,
                    len(got.tombstones),
                )
                return _Scope(got.index, got.inner, got.tombstones, dirty=bool(got.added or got.tombstones))
        built = self._build(ids, vecs, True, bar)
        self._save(name, built)
        return built

    def _save(self, name: str, scope: _Scope) -> None:
        """Snapshot an HNSW scope nobody else is changing (just built, or under the lock)."""
        if self.snapshot_dir is None or not scope.hnsw:
            return
        try:
            snapshot.save(self.snapshot_dir, name, scope.index)
            scope.dirty = False
        except Exception:  # a full disk costs the next start time, not this index
            log.exception("could not write the index snapshot of scope %s", name)

    def save_snapshots(self) -> int:
        """Write every HNSW scope changed since its snapshot (orderly shutdown); returns how many."""
        if self.snapshot_dir is None:
            return 0
        self.wait_maintenance()
        with self._lock:  # searches wait: this runs once the server stopped taking requests
            todo = [(n, e) for n, e in self._scopes.items() if e.hnsw and e.dirty and e.journal is None]
            for name, entry in todo:
                self._save(name, entry)
            snapshot.remove_except(self.snapshot_dir, {n for n, e in self._scopes.items() if e.hnsw})
        return len(todo)

    def __len__(self) -> int:
        with self._lock:
            return len(self._id_scope)

    def __contains__(self, entry_id: object) -> bool:
        with self._lock:
            return entry_id in self._id_scope

    def scope_size(self, scope: str) -> int:
        with self._lock:
            entry = self._scopes.get(scope)
            return entry.live if entry is not None else 0

    def scope_kind(self, scope: str) -> str | None:
        """'flat', 'hnsw' or None: which index serves a scope (metrics, tests)."""
        with self._lock:
            entry = self._scopes.get(scope)
            return None if entry is None else ("hnsw" if entry.hnsw else "flat")

    def stats(self) -> dict[str, int]:
        """Entry/scope counts and an estimate of resident bytes (vectors, HNSW graph, Python id map)."""
        with self._lock:
            index_bytes = sum(self._index_bytes(e) for e in self._scopes.values())
            id_map_bytes = sys.getsizeof(self._id_scope) + 32 * len(self._id_scope)  # table + int keys
            return {
                "entries": len(self._id_scope),
                "scopes": len(self._scopes),
                "hnsw_scopes": sum(e.hnsw for e in self._scopes.values()),
                "tombstones": sum(len(e.tombstones) for e in self._scopes.values()),
                "index_bytes": index_bytes,
                "id_map_bytes": id_map_bytes,
                "bytes": index_bytes + id_map_bytes,
            }

    def _index_bytes(self, entry: _Scope) -> int:
        if not entry.hnsw:
            return entry.index.nbytes
        graph = entry.inner.hnsw
        size = int(entry.index.ntotal) * (4 * self.dim + 8)  # float32 vectors + int64 id map
        size += 4 * graph.neighbors.size() + 4 * graph.levels.size() + 8 * graph.offsets.size()
        return size + 72 * len(entry.tombstones)
