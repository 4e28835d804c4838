"""The on-disk cache of exported ONNX models, shared by the encoder and the cross-encoder: where it
lives, what a model's key covers (file hashes, library versions), the CPU session, and a cached file
that will not open replaced by a fresh export.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STALE_TEMP_S = 600  # an export temp file this old belongs to a dead process, not a concurrent export


def cache_root() -> Path:
    """``$CACHEGW_CACHE_DIR`` (the engine's converted models live there too), else ``~/.cache/cachegw``."""
    return Path(os.environ.get("CACHEGW_CACHE_DIR") or "~/.cache/cachegw").expanduser()


def package_version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cpu_session(path: Path, threads: int) -> Any:
    """An ORT CPU session with the graph fused, ``threads`` intra-op threads that never spin idle."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if threads > 1:  # idle workers must not busy-wait against the gateway's event loop
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def open_or_export(
    path: Path, open_fn: Callable[[Path], Any], export_fn: Callable[[], None]
) -> tuple[Any, bool]:
    """``(session, exported)``: the cached model at ``path`` if ``open_fn`` accepts it, else a fresh export.

    ``open_fn`` raises on anything wrong (corrupt, truncated, stale, a probe that disagrees); such a file is
    deleted and exported again, so a bad cache can never serve.
    """
    if path.exists():
        try:
            return open_fn(path), False
        except Exception as exc:
            log.warning("cached ONNX model %s is unusable (%s); exporting it again", path, exc)
            path.unlink(missing_ok=True)
    export_fn()
    return open_fn(path), True
