"""HNSW scopes saved to disk, so a restart reads the graph back instead of rebuilding it.

Building HNSW is the slow part of a start: about 3.5 minutes for one scope of 1M entries on 2 cores,
where reading the same file back takes seconds. The database stays the source of truth, and a snapshot
only saves time. On load it is reconciled with the rows just read from the database:

- ids the database no longer has (deleted, expired, flagged) become tombstones;
- ids the snapshot lacks (written after it, e.g. before a kill -9) are added to the graph;
- an id whose vector differs (SQLite may reuse the id of a deleted last row) or too much drift makes the
  caller build the scope from scratch.

So a stale snapshot gives the same hits as a fresh build, and a missing, corrupt or mismatched file (other
dimension, other M) is ignored with a warning. Files are written to a temporary name and renamed, so a
crash mid-write leaves the previous snapshot or none, never half a file under the real name.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np

log = logging.getLogger(__name__)

SUFFIX = ".hnsw"
_COMPARE_CHUNK = 50_000  # rows of vectors compared at a time: bounds the extra memory at 1M entries


def path_for(directory: Path, scope: str) -> Path:
    """One file per scope, named by a hash (scopes are hashes already, but may hold any text)."""
    return directory / (hashlib.sha256(scope.encode()).hexdigest()[:32] + SUFFIX)


def save(directory: Path, scope: str, index: Any) -> Path:
    """Write ``index`` (faiss IndexIDMap over IndexHNSWFlat) for ``scope``; the caller owns it meanwhile."""
    directory.mkdir(parents=True, exist_ok=True)
    final = path_for(directory, scope)
    tmp = final.with_suffix(SUFFIX + ".tmp")
    try:
        faiss.write_index(index, str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except Exception:
        tmp.unlink(missing_ok=True)
        raise
    return final


def remove_except(directory: Path, scopes: set[str]) -> int:
    """Delete the snapshots (and leftover temporary files) of every scope not in ``scopes``."""
    if not directory.is_dir():
        return 0
    keep = {path_for(directory, s).name for s in scopes}
    gone = 0
    for p in directory.iterdir():
        if (p.name.endswith(SUFFIX) and p.name not in keep) or p.name.endswith(SUFFIX + ".tmp"):
            p.unlink(missing_ok=True)
            gone += 1
    return gone


@dataclass
class Restored:
    """A scope read back from disk and reconciled: what ScopedIndex needs to serve it."""

    index: Any  # faiss.IndexIDMap
    inner: Any  # its faiss.IndexHNSWFlat
    tombstones: set[int] = field(default_factory=set)
    added: int = 0


def _read(path: Path, dim: int, m: int) -> tuple[Any, Any] | None:
    try:
        index = faiss.read_index(str(path))
    except Exception as exc:  # faiss raises RuntimeError on truncated or foreign files
        log.warning("index snapshot %s unreadable (%s); building the scope instead", path, exc)
        return None
    if not isinstance(index, faiss.IndexIDMap):
        log.warning("index snapshot %s is a %s, not an id-mapped HNSW; ignored", path, type(index).__name__)
        return None
    inner = faiss.downcast_index(index.index)
    if not isinstance(inner, faiss.IndexHNSWFlat):
        log.warning("index snapshot %s wraps a %s, not HNSW; ignored", path, type(inner).__name__)
        return None
    got_m = inner.hnsw.nb_neighbors(1)
    if index.d != dim or got_m != m or index.metric_type != faiss.METRIC_INNER_PRODUCT:
        log.warning(
            "index snapshot %s has dim %d, M %d (want %d, %d); building the scope instead",
            path,
            index.d,
            got_m,
            dim,
            m,
        )
        return None
    return index, inner


def restore(
    directory: Path, scope: str, ids: np.ndarray, vecs: np.ndarray, m: int, max_drift: float
) -> Restored | None:
    """The saved scope brought up to the database's ``ids``/``vecs``, or None: then build from scratch.

    ``max_drift``: the share of the snapshot that may be stale or missing before a fresh build is the
    better deal (tombstones slow searches down, and each added vector costs what building it would).
    """
    path = path_for(directory, scope)
    if not path.is_file():
        return None
    read = _read(path, vecs.shape[1], m)
    if read is None:
        return None
    index, inner = read
    snap_ids = faiss.vector_to_array(index.id_map).astype(np.int64)
    if len(np.unique(snap_ids)) != len(snap_ids):
        log.warning("index snapshot %s repeats ids; building the scope instead", path)
        return None
    common, at_snap, at_db = np.intersect1d(snap_ids, ids, assume_unique=True, return_indices=True)
    stale = np.setdiff1d(snap_ids, common, assume_unique=True)
    fresh = np.setdiff1d(np.arange(len(ids)), at_db, assume_unique=True)
    if len(stale) + len(fresh) > max_drift * max(len(snap_ids), 1):
        drift = len(stale) + len(fresh)
        log.info("index snapshot of scope %s: %d of %d out of date; rebuilding", scope, drift, len(snap_ids))
        return None
    for start in range(0, len(common), _COMPARE_CHUNK):
        rows = at_snap[start : start + _COMPARE_CHUNK]
        saved = inner.reconstruct_batch(rows.astype(np.int64))  # graph positions = id_map positions
        if not np.array_equal(saved, vecs[at_db[start : start + _COMPARE_CHUNK]]):
            log.info("index snapshot of scope %s has an id with another vector now; rebuilding", scope)
            return None
    if len(fresh):
        index.add_with_ids(np.ascontiguousarray(vecs[fresh]), ids[fresh])
    return Restored(index, inner, set(stale.tolist()), len(fresh))
