"""The ONNX Runtime encoder against the torch one, on the real packaged MiniLM (no mocks).

The verifier was trained on the torch encoder's vectors, so the ONNX ones must match them (cosine >= 0.9999
per row) for any text the gateway may see: empty, Unicode, long enough to be truncated, batched with padding.
The one-time export is cached on disk: reused when present, redone when the file is corrupt.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from cachegw.embeddings.encoder import Encoder, make_encoder
from cachegw.embeddings.onnx_encoder import OnnxEncoder, _plan_batches

MIN_COSINE = 0.9999


def _long_text(words: int) -> str:
    """Varied words, so truncating at 128 instead of 256 tokens would change the mean (a repeat would not)."""
    rng = random.Random(7)
    vocab = (
        "cache gateway latency embedding vector query answer model token server network request response "
        "database index memory thread python rust kernel batch paris london river mountain music history "
        "science economy garden kitchen window bicycle ocean planet winter summer doctor teacher"
    ).split()
    return " ".join(rng.choice(vocab) for _ in range(words))


TEXTS = [
    "",
    " ",
    "?",
    "hi",
    "How do I reset my password?",
    "how do i reset my password",
    "What is the capital of France?",
    "  leading and trailing whitespace\n\t",
    "Qu'est-ce que la mise en cache sémantique ? Ça marche très bien.",
    "日本語のテキストを埋め込みます。東京は日本の首都です。",
    "Привет, как дела? Это тест кириллицы.",
    "مرحبا بك في بوابة التخزين المؤقت",
    "emoji 🚀🔥👍 and symbols ∑∫√ ≤ ≥ ©®™",
    "def f(x):\n    return {'a': [1, 2, 3], 'b': None}  # code",
    "SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY id DESC LIMIT 10;",
    "https://example.com/path?q=semantic+cache&lang=en#section-2",
    "Explain, in three sentences, why the sky looks blue during the day but red at sunset.",
    "ALL CAPS QUESTION ABOUT SHIPPING TIMES TO CANADA",
    "a " * 300,
    _long_text(2000),
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cachegw-cache")


@pytest.fixture(scope="module")
def onnx_enc(cache_dir: Path) -> OnnxEncoder:
    """A fresh export into an empty CACHEGW_CACHE_DIR (the environment variable, not the argument)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CACHEGW_CACHE_DIR", str(cache_dir))
        enc = OnnxEncoder().load()
    assert enc.exported
    assert enc.model_file is not None and enc.model_file.is_relative_to(cache_dir / "embeddings")
    return enc


@pytest.fixture(scope="module")
def torch_enc() -> Encoder:
    return Encoder()


@pytest.fixture(scope="module")
def reference(torch_enc: Encoder) -> np.ndarray:
    return torch_enc.encode(TEXTS)


def test_matches_torch_encoder_row_by_row(onnx_enc: OnnxEncoder, reference: np.ndarray) -> None:
    vecs = onnx_enc.encode(TEXTS)
    assert vecs.shape == (len(TEXTS), 384) and vecs.dtype == np.float32 and vecs.flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    cos = (vecs * reference).sum(axis=1)
    assert cos.min() >= MIN_COSINE, dict(zip(TEXTS, cos.round(6), strict=True))


def test_single_and_batched_calls_agree(onnx_enc: OnnxEncoder, reference: np.ndarray) -> None:
    """Padding a text inside a batch must not change its vector, nor must splitting into batches."""
    single = np.vstack([onnx_enc.encode([t]) for t in TEXTS])
    batched = onnx_enc.encode(TEXTS)
    np.testing.assert_allclose(single, batched, atol=1e-5)
    small = OnnxEncoder(threads=1, batch_size=3, cache_dir=onnx_enc.model_file.parents[2]).encode(TEXTS)
    np.testing.assert_allclose(small, batched, atol=1e-5)  # sorted by length, split, put back in order
    assert (single * reference).sum(axis=1).min() >= MIN_COSINE
    assert onnx_enc.encode([]).shape == (0, 384)


def test_tokenization_is_sentence_transformers(onnx_enc: OnnxEncoder, torch_enc: Encoder) -> None:
    """Same ids and mask, incl. truncation at max_seq_length 256 (tokenizer.json alone says 128)."""
    model = torch_enc._load()
    prep = getattr(model, "preprocess", None) or model.tokenize
    want = prep(TEXTS)
    ids, mask = onnx_enc._tokenizer.batch(TEXTS)
    assert ids.shape[1] == 256
    np.testing.assert_array_equal(ids, want["input_ids"].numpy())
    np.testing.assert_array_equal(mask, want["attention_mask"].numpy())


def test_batches_are_cut_by_length() -> None:
    """One long text among short ones gets its own run instead of padding all of them to its length."""
    runs = _plan_batches([12] * 63 + [200], max_batch=64)
    assert runs == [(0, 63), (63, 64)]
    runs = _plan_batches(sorted([10, 11, 12, 13] * 40), max_batch=64)
    assert runs[0][0] == 0 and runs[-1][1] == 160 and all(a < b for a, b in runs)
    assert all(b == c for (_, b), (c, _) in zip(runs, runs[1:], strict=False))
    assert max(b - a for a, b in runs) <= 64


def test_cached_export_is_reused(onnx_enc: OnnxEncoder, cache_dir: Path) -> None:
    path = onnx_enc.model_file
    mtime = path.stat().st_mtime_ns
    again = OnnxEncoder(cache_dir=cache_dir).load()
    assert again.model_file == path and not again.exported
    assert path.stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir()] == ["model.onnx"]  # no temp file left behind
    np.testing.assert_array_equal(again.encode(TEXTS[:5]), onnx_enc.encode(TEXTS[:5]))


def test_make_encoder(onnx_enc: OnnxEncoder, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEGW_CACHE_DIR", str(cache_dir))
    auto = make_encoder("auto")
    assert isinstance(auto, OnnxEncoder) and not auto.exported and auto.model_file == onnx_enc.model_file
    assert isinstance(make_encoder("torch"), Encoder)
    explicit = make_encoder("onnx", threads=2, cache_dir=cache_dir)
    assert isinstance(explicit, OnnxEncoder) and explicit.model_file is None  # "onnx" loads lazily
    np.testing.assert_allclose(explicit.encode(TEXTS[:4]), auto.encode(TEXTS[:4]), atol=1e-5)
    assert explicit.model_file == onnx_enc.model_file and not explicit.exported
    with pytest.raises(ValueError):
        make_encoder("tensorflow")


def test_make_encoder_auto_falls_back_to_torch(tmp_path: Path) -> None:
    """A model folder ONNX cannot handle (here: no weights) gives the torch encoder, not an error."""
    assert isinstance(make_encoder("auto", model_path=str(tmp_path)), Encoder)


def test_corrupt_cached_model_is_exported_again(
    onnx_enc: OnnxEncoder, reference: np.ndarray, tmp_path: Path
) -> None:
    good = onnx_enc.model_file
    bad = tmp_path / good.relative_to(good.parents[2])  # same <cache>/embeddings/<name>-<hash>/model.onnx
    bad.parent.mkdir(parents=True)
    shutil.copyfile(good, bad)
    with bad.open("r+b") as f:  # garbage over the protobuf header and into the weights
        f.write(b"\x00garbage\xff" * 100_000)
    enc = OnnxEncoder(cache_dir=tmp_path).load()
    assert enc.model_file == bad and enc.exported
    assert (enc.encode(TEXTS) * reference).sum(axis=1).min() >= MIN_COSINE
