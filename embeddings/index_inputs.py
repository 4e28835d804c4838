"""What ScopedIndex accepts: unit float32 vectors of its width, int64 ids, string scopes; anything
that would silently give wrong cosines or ids is a ValueError at the call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_NORM_TOL = 1e-3


def check_vecs(vecs: Any, dim: int, what: str = "vecs") -> np.ndarray:
    """Reject what would silently give wrong cosines: wrong dtype or width, NaN, rows that are not unit."""
    if not isinstance(vecs, np.ndarray):
        raise ValueError(f"{what} must be a numpy array, got {type(vecs).__name__}")
    if vecs.dtype != np.float32:
        raise ValueError(f"{what} must be float32, got {vecs.dtype} (use .astype(np.float32))")
    if vecs.ndim != 2 or vecs.shape[1] != dim:
        raise ValueError(f"{what} must have shape (n, {dim}), got {vecs.shape}")
    norms = np.linalg.norm(vecs, axis=1)
    if not np.all(np.isfinite(norms)):
        raise ValueError(f"{what} contains NaN or inf")
    if norms.size and np.max(np.abs(norms - 1.0)) > _NORM_TOL:
        raise ValueError(f"{what} must be L2-normalised (row norms {norms.min():.4f}..{norms.max():.4f})")
    return np.ascontiguousarray(vecs)


def check_ids(ids: Any, n: int) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"ids must be a 1-D array of {n} ids, got shape {arr.shape}")
    if n and arr.dtype.kind not in "iu":
        raise ValueError(f"ids must be integers, got {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if n and arr.min() < 0:
        raise ValueError("ids must be non-negative (FAISS uses -1 for 'no result')")
    if np.unique(arr).shape[0] != n:
        raise ValueError("ids contain duplicates")
    return arr


def check_scope(scope: Any) -> str:
    if not isinstance(scope, str) or not scope:
        raise ValueError(f"scope must be a non-empty string, got {scope!r}")
    return scope
