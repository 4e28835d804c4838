"""Exact inner-product search over a growable numpy matrix: the small-scope tier of ScopedIndex
(embeddings/index.py), one BLAS matvec per query and O(1) deletes.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class FlatIndex:
    """Exact inner-product search over a growable numpy matrix: the small-scope tier.

    Mirrors the part of faiss' IndexIDMap interface that ScopedIndex uses. A delete moves the last row
    into the hole (O(dim), where faiss' remove_ids shifts everything after it).
    """

    def __init__(self, dim: int) -> None:
        self.d, self.ntotal = dim, 0
        self.ids = np.empty(0, np.int64)  # grows by doubling: a one-entry tenant costs one row, not a block
        self.vecs = np.empty((0, dim), np.float32)

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.vecs.nbytes

    def _reserve(self, need: int) -> None:
        if need > len(self.ids):
            cap, n = max(need, 2 * len(self.ids)), self.ntotal
            self.ids = np.concatenate([self.ids[:n], np.empty(cap - n, np.int64)])
            self.vecs = np.concatenate([self.vecs[:n], np.empty((cap - n, self.d), np.float32)])

    def add_with_ids(self, vecs: np.ndarray, ids: np.ndarray) -> None:
        n, need = self.ntotal, self.ntotal + len(ids)
        self._reserve(need)
        self.ids[n:need], self.vecs[n:need] = ids, vecs
        self.ntotal = need

    def append(self, i: int, vec: Any) -> None:
        """One row at a time (rebuild's staging); norms are checked later for the whole array at once."""
        if not isinstance(vec, np.ndarray) or vec.dtype != np.float32 or vec.size != self.d:
            got = f"{getattr(vec, 'dtype', type(vec).__name__)} {getattr(vec, 'shape', '')}"
            raise ValueError(f"vector of id {i} must be a float32 array of {self.d} values, got {got}")
        self._reserve(self.ntotal + 1)
        self.ids[self.ntotal], self.vecs[self.ntotal] = i, vec.reshape(-1)
        self.ntotal += 1

    def remove(self, ids: np.ndarray) -> None:
        for pos in np.flatnonzero(np.isin(self.ids[: self.ntotal], ids))[::-1]:  # descending keeps it valid
            last = self.ntotal - 1
            self.ids[pos], self.vecs[pos] = self.ids[last], self.vecs[last]
            self.ntotal = last

    def entries(self) -> tuple[np.ndarray, np.ndarray]:
        return self.ids[: self.ntotal].copy(), self.vecs[: self.ntotal].copy()

    def search(self, q: np.ndarray, k: int, params: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """(cosines, ids) of the k best rows per query, best first, like faiss.Index.search."""
        x = self.vecs[: self.ntotal]
        sims = (x @ q[0])[None, :] if len(q) == 1 else q @ x.T  # a matvec for the usual single query
        if k == 1:
            top = sims.argmax(axis=1)[:, None]
        else:
            top = (
                np.argpartition(-sims, k - 1, axis=1)[:, :k] if k < x.shape[0] else np.argsort(-sims, axis=1)
            )
            top = np.take_along_axis(top, np.argsort(-np.take_along_axis(sims, top, axis=1), axis=1), axis=1)
        return np.take_along_axis(sims, top, axis=1), self.ids[top]
