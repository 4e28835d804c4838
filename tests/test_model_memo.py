"""A question asked again in the same words runs no model (embeddings/memo.py): the kept vector
and score are the ones the models gave, the verdicts are those of a gateway that keeps nothing, and the
memo is bounded. Real models (the packaged MiniLM on ONNX Runtime, the shipped cross-encoder), a real
gateway over HTTP in front of testkit's upstream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from cachegw.embeddings.batcher import EmbeddingBatcher
from cachegw.embeddings.encoder import make_encoder
from cachegw.embeddings.memo import MEMO_SCOPE, PairScores, QueryVectors
from cachegw.gateway.api.app import build_app
from cachegw.gateway.cache.verifier_loader import load_verifier
from cachegw.gateway.compose import started_gateway
from cachegw.gateway.config import load_settings
from cachegw.gateway.parts import Parts
from testkit.servers import Upstream, recording_upstream, serve_in_thread

QUESTIONS = [f"How do I reset my password for account type {i}?" for i in range(6)]
RETYPED = [q[0].lower() + q[1:] + " ?" for q in QUESTIONS]  # an exact-tier miss, a semantic hit


@pytest.fixture(scope="module")
def encoder():  # type: ignore[no-untyped-def]
    enc = make_encoder("onnx")
    enc.encode(["warm up"])
    return enc


async def test_a_repeated_text_is_not_encoded_again(encoder) -> None:  # type: ignore[no-untyped-def]
    batcher = EmbeddingBatcher(encoder, window_ms=0.0)
    vectors = QueryVectors(batcher, size=8)
    first = await vectors.embed(RETYPED[0], "scope-a")
    assert batcher.texts == 1
    again = await vectors.embed(RETYPED[0], "scope-a")
    assert batcher.texts == 1 and again is first and not again.flags.writeable
    np.testing.assert_allclose(first, encoder.encode([RETYPED[0]])[0], atol=1e-5)
    both = await vectors.embed_many([RETYPED[1], RETYPED[0], RETYPED[1]], "scope-a")  # one new text
    assert batcher.texts == 2 and both.shape == (3, encoder.dim)
    np.testing.assert_array_equal(both[1], first)
    np.testing.assert_array_equal(both[0], both[2])
    np.testing.assert_allclose(both[0], encoder.encode([RETYPED[1]])[0], atol=1e-5)
    await vectors.embed(RETYPED[0], "scope-b")  # another tenant's scope: its own repeat, not a's
    assert batcher.texts == 3
    off = QueryVectors(batcher, size=0)
    await off.embed(RETYPED[0], "scope-a")
    await off.embed(RETYPED[0], "scope-a")
    assert batcher.texts == 5  # nothing kept: each call encodes
    batcher.close()


class Counting:
    """The real cross-encoder, counting the pairs it scores."""

    def __init__(self, inner: object) -> None:
        self.inner, self.pairs = inner, 0

    def score_batch(self, q_new: list[str], q_old: list[str]) -> np.ndarray:
        self.pairs += len(q_new)
        return self.inner.score_batch(q_new, q_old)  # type: ignore[attr-defined]


def test_a_repeated_pair_is_not_scored_again() -> None:
    real = load_verifier(load_settings(None).cache).cross
    assert real is not None
    counting = Counting(real)
    scores = PairScores(counting, size=8)
    a = ["Where is my order?", "How do I learn Java?"]
    b = ["Where is my parcel?", "How do I learn Python?"]
    want = real.score_batch(a, b)
    got = scores.score_batch(a, b)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert counting.pairs == 2
    again = scores.score_batch([a[1], a[0], "What is the capital of France?"], [b[1], b[0], "Paris?"])
    assert counting.pairs == 3  # only the new pair was scored
    assert again[0] == got[1] and again[1] == got[0]
    token = MEMO_SCOPE.set("another tenant's scope")
    try:
        np.testing.assert_array_equal(scores.score_batch(a, b), got)
        assert counting.pairs == 5  # kept per scope: scored again
    finally:
        MEMO_SCOPE.reset(token)


@contextlib.contextmanager
def gateway(data_dir: Path, upstream: str, memo: int) -> Iterator[tuple[str, Parts]]:
    s = load_settings(None, data_dir=str(data_dir), backends=(f"{upstream}/v1",))
    s = s.model_copy(update={"cache": s.cache.updated({"model_memo_entries": memo})})
    app = build_app(lambda: started_gateway(s, progress=False))
    with serve_in_thread(app, lifespan="on") as url:
        yield url, app.state.parts()


def ask(url: str, question: str) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": question}], "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    r.raise_for_status()
    return r


def verdicts(url: str, parts: Parts, rounds: int) -> tuple[list[tuple[str, str | None]], list[int]]:
    """Each re-typed question's (x-cache, x-cache-similarity) per round, and the texts encoded per round."""
    for q in QUESTIONS:
        ask(url, q)  # stored
    batcher = parts.cache.semantic.batcher
    assert batcher is not None
    seen, encoded = [], []
    for _ in range(rounds):
        before = batcher.texts
        for q in RETYPED:
            r = ask(url, q)
            seen.append((r.headers["x-cache"], r.headers.get("x-cache-similarity")))
        encoded.append(batcher.texts - before)
    return seen, encoded


def test_repeats_through_the_gateway_hit_alike_and_run_no_model(tmp_path: Path) -> None:
    with serve_in_thread(recording_upstream(Upstream(model="m"))) as upstream:
        with gateway(tmp_path / "memo", upstream, 4096) as (url, parts):
            kept, kept_encoded = verdicts(url, parts, rounds=2)
        with gateway(tmp_path / "off", upstream, 0) as (url, parts):
            plain, plain_encoded = verdicts(url, parts, rounds=2)
    assert kept == plain  # the same hits at the same similarities
    assert all(x == "semantic-hit" for x, _ in kept)
    assert kept_encoded == [len(RETYPED), 0] and plain_encoded == [len(RETYPED)] * 2
