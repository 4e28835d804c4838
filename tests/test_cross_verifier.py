"""The cross-encoder verifier stage: shipped artifact, int8 ONNX export and its cache, the combined rule, CLI.

Real parts throughout: the shipped LoRA artifact on the packaged MiniLM, a real export and quantization into a
temporary cache folder, real ONNX Runtime sessions.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cachegw.embeddings.cross_encoder import ARTIFACT_PATH, CrossEncoder  # noqa: E402
from cachegw.embeddings.cross_onnx import PROBE_TOLERANCE, CrossScorer  # noqa: E402
from cachegw.embeddings.onnx_encoder import OnnxEncoder  # noqa: E402
from cachegw.gateway.cache.verifier_loader import load_verifier  # noqa: E402
from cachegw.gateway.offline.train_verifier import main_train  # noqa: E402
from cachegw.policies.verifier import DEFAULT_RULE, Verifier  # noqa: E402

SAME = ("How do I invest my money wisely?", "How can I invest my money wisely?")
DIFFERENT = ("How do I learn Java?", "How do I learn Python?")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cross-cache")


@pytest.fixture(scope="module")
def scorer(cache_dir: Path) -> CrossScorer:
    return CrossScorer(cache_dir=cache_dir).load()


@pytest.fixture(scope="module")
def encoder() -> OnnxEncoder:
    return OnnxEncoder().load()


def test_shipped_artifact_is_small_and_holds_only_the_adapter() -> None:
    assert ARTIFACT_PATH.stat().st_size < 4_000_000  # the base MiniLM weights are not in it
    with np.load(ARTIFACT_PATH, allow_pickle=False) as z:
        names = z.files
    assert any("lora_a" in n for n in names) and "head.weight" in names
    assert not any(n.endswith("attention.self.query.base.weight") for n in names)


def test_first_load_exports_int8_then_reuses_it(scorer: CrossScorer, cache_dir: Path) -> None:
    assert scorer.exported and scorer.model_file is not None
    assert scorer.model_file.is_relative_to(cache_dir) and scorer.model_file.stat().st_size < 40_000_000
    again = CrossScorer(cache_dir=cache_dir).load()
    assert not again.exported and again.model_file == scorer.model_file
    assert not list(scorer.model_file.parent.glob(".export-*"))  # no temp files left behind


def test_int8_scores_follow_torch_and_separate_the_pairs(scorer: CrossScorer) -> None:
    a = [SAME[0], DIFFERENT[0], "How do I reset my password?", "What is the capital of France?"]
    b = [SAME[1], DIFFERENT[1], "How can I reset my password?", "How tall is the Eiffel Tower?"]
    int8 = scorer.score_batch(a, b)
    ref = CrossEncoder().score_batch(a, b)
    assert np.max(np.abs(int8 - ref)) <= PROBE_TOLERANCE, (int8, ref)
    assert int8[0] > 0.7 and int8[2] > 0.7  # paraphrases
    assert int8[1] < 0.3 and int8[3] < 0.3  # another language; another question about the same place
    assert scorer.score_batch([], []).shape == (0,)
    with pytest.raises(ValueError):
        scorer.score_batch(["a"], [])


def test_a_pair_scores_the_same_alone_or_among_others(scorer: CrossScorer) -> None:
    """Dynamic int8 scales activations per call: pairs are scored one by one so company cannot matter."""
    a = [SAME[0], DIFFERENT[0], "a much longer question about the weather in Paris in May this year?"]
    b = [SAME[1], DIFFERENT[1], "what is the weather like in Paris in May?"]
    batch = scorer.score_batch(a, b)
    single = [scorer.score_batch([x], [y])[0] for x, y in zip(a, b, strict=True)]
    assert np.allclose(batch, single, atol=1e-6)


def test_corrupt_cached_model_is_exported_again(scorer: CrossScorer, cache_dir: Path) -> None:
    assert scorer.model_file is not None
    scorer.model_file.write_bytes(b"not an onnx file")
    fresh = CrossScorer(cache_dir=cache_dir).load()
    assert fresh.exported
    a, b = [SAME[0]], [SAME[1]]
    assert abs(fresh.score_batch(a, b)[0] - scorer.score_batch(a, b)[0]) < 1e-5


class _Counting:
    """The real scorer, counting the pairs it is asked about (to see which pairs reach the second stage)."""

    def __init__(self, inner: CrossScorer) -> None:
        self.inner, self.pairs = inner, 0

    def score_batch(self, q_new: list[str], q_old: list[str]) -> np.ndarray:
        self.pairs += len(q_new)
        return self.inner.score_batch(q_new, q_old)


def test_combined_rule_and_skip_of_hopeless_pairs(scorer: CrossScorer, encoder: OnnxEncoder) -> None:
    counting = _Counting(scorer)
    both = Verifier.load(cross=counting)
    mlp_only = Verifier.load()
    a = [SAME[0], DIFFERENT[0], "What is the best phone under 15000?"]
    b = [SAME[1], DIFFERENT[1], "What is the best phone under 20000?"]
    u, v = encoder.encode(a), encoder.encode(b)
    p_mlp = mlp_only.score_batch(a, b, u, v)
    ordered = [sorted(pair) for pair in zip(a, b, strict=True)]  # the order the verifier reads them in
    p_cross = scorer.score_batch([x for x, _ in ordered], [y for _, y in ordered])
    combined = both.score_batch(a, b, u, v)
    assert combined[2] == 0.0  # the number guard fires before either model
    assert np.allclose(combined[:2], np.sqrt(p_mlp[:2] * p_cross[:2]), atol=1e-5)
    everything = type(DEFAULT_RULE)(min_cosine=0.0, min_prob=DEFAULT_RULE.min_prob)  # no cosine pre-filter
    verdicts = both.check_batch(a, b, u, v, everything)
    assert verdicts[0].accepted and verdicts[0].reason == "hit"
    assert not verdicts[1].accepted and verdicts[2].reason == "guard:numbers"
    # A pair the MLP already puts under min_prob**2 never costs a cross-encoder call.
    counting.pairs = 0
    rule = type(DEFAULT_RULE)(min_cosine=0.0, min_prob=0.999)
    hopeless = both.check_batch([DIFFERENT[0]], [DIFFERENT[1]], u[1:2], v[1:2], rule)
    assert p_mlp[1] < rule.min_prob**2 and counting.pairs == 0 and not hopeless[0].accepted


def test_the_verdict_does_not_depend_on_which_query_came_first(
    scorer: CrossScorer, encoder: OnnxEncoder
) -> None:
    """The cross-encoder alone is not symmetric (its scores below differ by order); the verifier reads
    every pair in one order, so a paraphrase hits whichever of the two was stored first."""
    a = [SAME[0], "How do I sort a list in Python?", "Where can I watch movies online for free?"]
    b = [SAME[1], "How can I sort a Python list?", "What are the best free movie sites?"]
    assert not np.allclose(scorer.score_batch(a, b), scorer.score_batch(b, a), atol=1e-4)
    verifier = Verifier.load(cross=scorer)
    u, v = encoder.encode(a), encoder.encode(b)
    assert np.array_equal(verifier.score_batch(a, b, u, v), verifier.score_batch(b, a, v, u))


def test_load_verifier_follows_the_config(cache_dir: Path, tmp_path: Path) -> None:
    from cachegw.gateway.config import load_settings

    cache = load_settings(None).cache
    assert cache.verifier.cross_verifier and cache.verifier.cross_verifier_path == ""
    assert isinstance(load_verifier(cache, cache_dir).cross, CrossScorer)
    off = cache.updated({"cross_verifier": False})
    assert load_verifier(off, cache_dir).cross is None
    missing = cache.updated({"cross_verifier_path": str(tmp_path / "nope.npz")})
    with pytest.raises(FileNotFoundError):
        load_verifier(missing, cache_dir)
    # Not an artifact: refused at start (after the torch fallback fails too), not at every lookup later.
    (tmp_path / "broken.npz").write_bytes(b"not a cross-encoder")
    broken = cache.updated({"cross_verifier_path": str(tmp_path / "broken.npz")})
    with pytest.raises(ValueError, match="not a usable cross-encoder"):
        load_verifier(broken, cache_dir)


def test_train_verifier_cli_trains_the_cross_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pairs = tmp_path / "pairs.csv"
    rows = [
        ("How do I bake bread?", "What is the way to bake bread?", 1),
        ("How do I bake bread?", "How do I bake a cake?", 0),
        ("Where is Rome?", "In which country is Rome?", 1),
        ("Where is Rome?", "Where is Paris?", 0),
    ] * 6
    with pairs.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["question1", "question2", "is_duplicate"])
        w.writerows(rows)
    out = tmp_path / "v.npz"
    argv = ["--pairs", str(pairs), "--out", str(out), "--epochs", "2", "--cross", "--cross-epochs", "1"]
    assert main_train(argv) == 0
    cross = tmp_path / "v-cross.npz"
    assert out.is_file() and cross.is_file()
    assert f"cross_verifier_path = '{cross}'" in capsys.readouterr().out
    probs = CrossEncoder(cross).score_batch(["How do I bake bread?"], ["What is the way to bake bread?"])
    assert probs.shape == (1,) and 0.0 <= probs[0] <= 1.0
    assert main_train([*argv[:-1], "0"]) == 2
    assert "--cross-epochs must be > 0" in capsys.readouterr().err


RETYPED = [
    ("Where is my order?", "where is my order ??"),
    ("What is your refund policy?", "what is your refund policy ?"),
    ("Do you ship internationally?", "DO YOU SHIP INTERNATIONALLY?"),
    ("How do I reset my password?", "how do i reset my password"),
    ("Why was my card declined?", "Why was my card declined ?!"),
]


@pytest.mark.parametrize("a,b", RETYPED)
def test_default_verifier_accepts_a_question_retyped(
    a: str, b: str, scorer: CrossScorer, encoder: OnnxEncoder
) -> None:
    """Casing, spacing and end punctuation never change the question. QQP never shows such pairs, and the
    first cross-encoder, trained without re-typed copies, rejected "where is my order ??" (p 0.25)."""
    verifier = Verifier.load(cross=scorer)
    u, v = encoder.encode([b]), encoder.encode([a])
    verdict = verifier.check_batch([b], [a], u, v)[0]
    assert verdict.accepted, verdict


def test_training_can_continue_from_an_artifact(tmp_path: Path) -> None:
    """``init`` starts from the shipped adapter (fine-tuning it on new pairs, as bench/recall_pairs.py
    does with intents): with a zero learning rate the result scores as the shipped model does, while a
    fresh adapter from the same step does not."""
    from cachegw.embeddings.cross_encoder import CrossConfig, train_cross_encoder

    q1, q2 = [SAME[0], DIFFERENT[0]] * 2, [SAME[1], DIFFERENT[1]] * 2
    y = np.array([1, 0, 1, 0], dtype=np.float32)
    cfg = CrossConfig(epochs=1, lr=0.0, identity_fraction=0.0)
    kept, fresh = tmp_path / "kept.npz", tmp_path / "fresh.npz"
    meta = train_cross_encoder(q1, q2, y, kept, cfg, progress=lambda _: None, init=ARTIFACT_PATH)
    train_cross_encoder(q1, q2, y, fresh, cfg, progress=lambda _: None)
    assert meta["init"] == ARTIFACT_PATH.name
    pairs = ([SAME[0], DIFFERENT[0]], [SAME[1], DIFFERENT[1]])
    shipped = CrossEncoder(ARTIFACT_PATH).score_batch(*pairs)
    assert np.allclose(CrossEncoder(kept).score_batch(*pairs), shipped, atol=2e-3)
    assert not np.allclose(CrossEncoder(fresh).score_batch(*pairs), shipped, atol=0.05)
