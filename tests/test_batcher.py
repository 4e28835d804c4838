"""EmbeddingBatcher on the real MiniLM encoder: fewer encoder calls, same vectors, shared failures."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from cachegw.embeddings.batcher import EmbeddingBatcher
from cachegw.embeddings.encoder import Encoder

TEXTS = [
    "How do I reset my password?",
    "What is the capital of France?",
    "My card has not arrived yet.",
    "Explain the difference between a list and a tuple in Python.",
    "Can I change my PIN at an ATM?",
    "Why is the sky blue?",
    "How long does a bank transfer take?",
    "Write a haiku about autumn leaves.",
]


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    enc = Encoder()
    enc.encode(["warm up"])  # load torch + weights once for the whole module
    return enc


class Counting:
    """The real encoder, recording each call's texts; raises for the text 'boom' to test failure fan-out."""

    def __init__(self, enc: Encoder) -> None:
        self.enc = enc
        self.dim = enc.dim
        self.calls: list[list[str]] = []

    def encode(self, texts: list[str]) -> np.ndarray:
        self.calls.append(list(texts))
        if "boom" in texts:
            raise RuntimeError("encoder exploded")
        return self.enc.encode(texts)


async def test_concurrent_calls_share_encoder_calls_and_match_direct(encoder: Encoder) -> None:
    counting = Counting(encoder)
    batcher = EmbeddingBatcher(counting, window_ms=20.0, max_batch=64)
    vecs = await asyncio.gather(*(batcher.embed(t) for t in TEXTS))
    batcher.close()
    assert len(counting.calls) == 1 and sorted(counting.calls[0]) == sorted(TEXTS)
    for text, vec in zip(TEXTS, vecs, strict=True):
        direct = encoder.encode([text])[0]
        assert vec.shape == (384,) and vec.dtype == np.float32
        np.testing.assert_allclose(vec, direct, atol=1e-5)


async def test_max_batch_splits_and_dispatches_without_waiting(encoder: Encoder) -> None:
    counting = Counting(encoder)
    batcher = EmbeddingBatcher(counting, window_ms=60_000.0, max_batch=4)  # only max_batch can trigger
    t0 = time.perf_counter()
    out = await asyncio.wait_for(batcher.embed_many(TEXTS), timeout=30)
    assert time.perf_counter() - t0 < 30
    batcher.close()
    assert [len(c) for c in counting.calls] == [4, 4]
    assert out.shape == (8, 384)
    np.testing.assert_allclose(out, encoder.encode(TEXTS), atol=1e-5)
    assert batcher.batches == 2 and batcher.mean_batch == 4.0


async def test_single_caller_only_waits_the_window(encoder: Encoder) -> None:
    counting = Counting(encoder)
    batcher = EmbeddingBatcher(counting, window_ms=5.0)
    vec = await asyncio.wait_for(batcher.embed(TEXTS[0]), timeout=30)
    batcher.close()
    assert counting.calls == [[TEXTS[0]]] and abs(float(np.linalg.norm(vec)) - 1.0) < 1e-4


async def test_requests_arriving_while_busy_go_out_together(encoder: Encoder) -> None:
    counting = Counting(encoder)
    batcher = EmbeddingBatcher(counting, window_ms=0.0)
    first = asyncio.ensure_future(batcher.embed(TEXTS[0]))
    await asyncio.sleep(0.001)  # the first batch is now encoding in the worker thread
    rest = asyncio.gather(*(batcher.embed(t) for t in TEXTS[1:]))
    await asyncio.wait_for(asyncio.gather(first, rest), timeout=30)
    batcher.close()
    assert [len(c) for c in counting.calls] == [1, 7]


async def test_errors_reach_every_caller_of_the_batch(encoder: Encoder) -> None:
    counting = Counting(encoder)
    batcher = EmbeddingBatcher(counting, window_ms=20.0)
    results = await asyncio.gather(
        *(batcher.embed(t) for t in ["ok one", "boom", "ok two"]), return_exceptions=True
    )
    assert all(isinstance(r, RuntimeError) and "exploded" in str(r) for r in results)
    vec = await batcher.embed("still works afterwards")  # a failed batch does not wedge the batcher
    assert vec.shape == (384,)
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        await batcher.embed("too late")
    with pytest.raises(ValueError, match="str"):
        await EmbeddingBatcher(counting).embed(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_batch"):
        EmbeddingBatcher(counting, max_batch=0)
