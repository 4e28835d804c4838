"""The cheaper semantic hit: the query encoder with int8 weights, and the cross-encoder left out where
the MLP is sure (docs/verifier.md, "What a semantic hit runs"). Real models throughout: the packaged
MiniLM exported and quantized into a temporary cache, the shipped verifier and cross-encoder.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cachegw.embeddings.encoder import make_encoder
from cachegw.embeddings.onnx_encoder import INT8_PROBE_MIN_COSINE, OnnxEncoder
from cachegw.gateway.cache.verifier_loader import load_verifier
from cachegw.gateway.config import load_settings
from cachegw.policies.pair_diff import align
from cachegw.policies.verifier import DEFAULT_RULE, DecisionRule, Verifier

TEXTS = [
    "How do I reset my password?",
    "how do I reset my password ?",
    "What is the capital of France?",
    "Qu'est-ce que la mise en cache sémantique ?",
    "def f(x):\n    return x + 1",
    "Explain, in three sentences, why the sky looks blue during the day but red at sunset.",
    "word " * 300,
    "",
]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> tuple[OnnxEncoder, OnnxEncoder]:
    """(float32, int8) from one empty cache: the int8 file is quantized from the float32 export."""
    cache = tmp_path_factory.mktemp("cache")
    int8 = OnnxEncoder(cache_dir=cache, int8=True).load()
    assert int8.exported and int8.model_file is not None
    fp32 = OnnxEncoder(cache_dir=cache).load()
    assert not fp32.exported  # written on the way to the int8 file
    assert fp32.model_file is not None and fp32.model_file.parent == int8.model_file.parent
    return fp32, int8


def test_int8_vectors_stay_close_to_float32(encoders: tuple[OnnxEncoder, OnnxEncoder]) -> None:
    fp32, int8 = encoders
    a, b = fp32.encode(TEXTS), int8.encode(TEXTS)
    assert b.shape == a.shape and b.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(b, axis=1), 1.0, atol=1e-5)
    cos = (a * b).sum(axis=1)
    assert cos.min() >= INT8_PROBE_MIN_COSINE, dict(zip(TEXTS, cos.round(4), strict=True))
    assert cos.max() < 0.99999  # it is really the int8 graph


def test_int8_vector_does_not_depend_on_its_batch(encoders: tuple[OnnxEncoder, OnnxEncoder]) -> None:
    """Activations are quantized per call: each text runs alone, so a micro-batch changes nothing."""
    _, int8 = encoders
    together = int8.encode(TEXTS)
    alone = np.concatenate([int8.encode([t]) for t in TEXTS])
    np.testing.assert_array_equal(together, alone)
    assert np.array_equal(int8.encode(TEXTS[::-1])[::-1], together)


def test_int8_file_is_reused_and_a_corrupt_one_redone(encoders: tuple[OnnxEncoder, OnnxEncoder]) -> None:
    _, int8 = encoders
    assert int8.model_file is not None
    cache = int8.model_file.parents[2]
    again = OnnxEncoder(cache_dir=cache, int8=True).load()
    assert not again.exported and again.model_file == int8.model_file
    want = again.encode(TEXTS[:3])
    int8.model_file.write_bytes(b"not a model")
    redone = OnnxEncoder(cache_dir=cache, int8=True).load()
    assert redone.exported
    np.testing.assert_allclose(redone.encode(TEXTS[:3]), want, atol=1e-6)


def test_make_encoder_passes_int8(tmp_path: Path) -> None:
    enc = make_encoder("onnx", cache_dir=tmp_path, int8=True)
    assert isinstance(enc, OnnxEncoder) and enc.int8


class CountingCross:
    """The real cross-encoder, counting the pairs it is asked about."""

    def __init__(self, inner: object) -> None:
        self.inner, self.pairs = inner, 0

    def score_batch(self, q_new: list[str], q_old: list[str]) -> np.ndarray:
        self.pairs += len(q_new)
        return self.inner.score_batch(q_new, q_old)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def verifier() -> tuple[Verifier, CountingCross]:
    real = load_verifier(load_settings(None).cache)
    counting = CountingCross(real.cross)
    return Verifier(real.params, real.meta, counting), counting


PAIRS = [
    ("How do I reset my password?", "how do I reset my password ?"),  # the MLP is sure
    ("How do I invest my money wisely?", "How can I invest my money wisely?"),
    ("How do I learn Java?", "How do I learn Python?"),
    ("What is the best phone under 15000?", "What is the best phone under 20000?"),  # a guard
    ("Where is my order?", "Where is my parcel?"),
    ("What is the capital of France?", "How tall is the Eiffel Tower?"),  # under the cosine floor
]


@pytest.mark.parametrize("sure", [2.0, 0.97, 0.9])
def test_without_cross_agrees_with_the_full_check(
    verifier: tuple[Verifier, CountingCross], encoders: tuple[OnnxEncoder, OnnxEncoder], sure: float
) -> None:
    """Where it decides, it decides as ``check_aligned`` with the same rule; where it does not, the
    cross-encoder is needed; it never asks the cross-encoder itself."""
    v, counting = verifier
    fp32, _ = encoders
    rule = DecisionRule(min_cosine=DEFAULT_RULE.min_cosine, min_prob=DEFAULT_RULE.min_prob, sure=sure)
    for a, b in PAIRS:
        al = align(a, b)
        emb = fp32.encode([a, b])
        before = counting.pairs
        quick = v.without_cross(al, emb[:1], emb[1:], rule)
        assert counting.pairs == before
        full = v.check_aligned(al, emb[:1], emb[1:], rule)
        if quick is None:
            assert counting.pairs == before + 1, (a, b)
        else:
            assert counting.pairs == before, (a, b)
            assert quick == full, (a, b)


def test_a_sure_pair_skips_the_cross_encoder_only_under_a_fixed_threshold(
    verifier: tuple[Verifier, CountingCross], encoders: tuple[OnnxEncoder, OnnxEncoder]
) -> None:
    v, counting = verifier
    fp32, _ = encoders
    a, b = PAIRS[0]
    emb = fp32.encode([a, b])
    al = align(a, b)
    sure = DecisionRule(sure=0.9)
    verdict = v.without_cross(al, emb[:1], emb[1:], sure)
    assert verdict is not None and verdict.accepted
    before = counting.pairs
    assert v.check_aligned(al, emb[:1], emb[1:], sure).accepted and counting.pairs == before
    # a bound's line judges the real score (min_prob 0): the cross-encoder is asked
    line = DecisionRule(min_prob=0.0, sure=0.9)
    assert v.without_cross(al, emb[:1], emb[1:], line) is None
    v.check_aligned(al, emb[:1], emb[1:], line)
    assert counting.pairs == before + 1


def test_the_defaults_skip_the_cross_encoder_only_where_the_mlp_is_sure() -> None:
    """int8 stays opt-in: it lowered held-out recall (docs/verifier.md)."""
    c = load_settings(None).cache
    assert not c.encoder.int8 and DEFAULT_RULE.min_prob**2 < c.verifier.skip_cross_from <= 1.0
