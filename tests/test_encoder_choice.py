"""bench/encoder_choice.py: issue 31's bar as it judges a candidate, and the per-encoder vector cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import bench.encoder_models as models
from bench.encoder_choice import verdict
from cachegw.embeddings.onnx_encoder import OnnxEncoder


def row(precision: float, recall: float, wrong: int) -> dict[str, Any]:
    return {"precision": precision, "recall": recall, "false_hits": wrong}


TODAY = {"qqp": row(0.91, 0.32, 72), "banking77": row(0.98, 0.29, 28), "units": row(1.0, 0.3, 0)}


def test_the_bar_needs_recall_and_precision_on_both_sets_and_no_family_worse() -> None:
    better = {"qqp": row(0.92, 0.35, 60), "banking77": row(0.98, 0.30, 25), "units": row(1.0, 0.2, 0)}
    assert verdict(better, TODAY) == {"passes": True, "fails": []}
    less_precise = {**better, "qqp": row(0.905, 0.40, 90)}
    assert verdict(less_precise, TODAY)["fails"] == ["qqp: 0.905/0.4 against 0.91/0.32"]
    less_recall = {**better, "banking77": row(0.99, 0.28, 10)}
    assert not verdict(less_recall, TODAY)["passes"]
    family_wrong = {**better, "units": row(0.9, 0.5, 1)}
    assert verdict(family_wrong, TODAY)["fails"] == ["units: 1 wrong answers against 0"]


def test_vectors_are_embedded_once_in_chunks_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models, "CACHE", tmp_path)
    texts = ["how do I reset my password?", "cancel my card", "what is 2+2", "where is my parcel"]
    first = models.CachedVectors("l6", threads=1)
    got = first.encode(texts[:3], chunk=2)  # two chunks, each saved
    want = OnnxEncoder().load().encode(texts)
    np.testing.assert_allclose(got, want[:3], atol=1e-5)
    again = models.CachedVectors("l6", threads=1)
    np.testing.assert_allclose(again.encode(texts[:3]), got, atol=0)
    assert again._enc is None  # nothing re-embedded: no model loaded
    assert again.has(texts[:3]) and not again.has(texts)
    np.testing.assert_allclose(again.encode(texts)[3], want[3], atol=1e-5)
    assert models.CachedVectors("l6").has(texts)
