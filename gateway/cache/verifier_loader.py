"""The gateway's verifier from its ``[cache]`` settings: the pure policy (``policies/verifier.py``) given
the cross-encoder model it runs as a second stage (``embeddings/cross_onnx.py``, or torch as a fallback).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from cachegw.embeddings.cross_encoder import ARTIFACT_PATH as CROSS_PATH
from cachegw.embeddings.cross_encoder import CrossEncoder
from cachegw.embeddings.cross_onnx import CrossScorer
from cachegw.policies.verifier import PairScorer, Verifier

log = logging.getLogger(__name__)


def load_verifier(cache: Any, cache_dir: str | os.PathLike[str] | None = None) -> Verifier:
    """The gateway's verifier from ``[cache]`` settings (``verifier_path``, ``cross_verifier``...).

    The cross-encoder stage runs on int8 ONNX Runtime; when that cannot load (onnxruntime missing, export
    failure) it falls back to the same model on torch, slower (~12 ms per candidate) but the same decisions
    within int8 noise, rather than silently dropping the stage.
    """
    cross: PairScorer | None = None
    if cache.verifier.cross_verifier:
        artifact = Path(cache.verifier.cross_verifier_path or CROSS_PATH)
        if not artifact.is_file():
            raise FileNotFoundError(f"cross_verifier_path {artifact} does not exist")
        try:
            cross = CrossScorer(artifact, cache_dir=cache_dir).load()
        except Exception as exc:
            log.warning("cross-encoder on ONNX unusable (%s: %s); using torch", type(exc).__name__, exc)
            torch_cross = CrossEncoder(artifact)
            try:  # loaded now: a broken artifact must stop the start, not fail every lookup later
                torch_cross.load()
            except Exception as exc2:
                raise ValueError(
                    f"cross_verifier_path {artifact} is not a usable cross-encoder: {exc2}"
                ) from exc
            cross = torch_cross
    return Verifier.load(cache.verifier.path or None, cross)
