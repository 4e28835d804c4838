"""What each stage of a semantic hit costs, timed alone in one process (no HTTP, no other request).

The hit is bench.hit_path's: a stored "How do I reset my password for account type 3?" asked re-typed
("how ... ?"). Stages: the query embedding (MiniLM float32 on ONNX Runtime, one text and batches of 2-32,
one and two intra-op threads), the index search over 40 stored vectors, the alignment, the guards and MLP
(the verdict without the cross-encoder), one cross-encoder pair, the exact tier's database probe a
paraphrase makes (its own exact key is never stored), a vector or score kept by ``embeddings/memo.py``,
and the stored answer turned into the response's JSON.

    .venv/bin/python -m bench.hit_stages [--repeats 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import save, say
from cachegw.embeddings.batcher import EmbeddingBatcher
from cachegw.embeddings.encoder import make_encoder
from cachegw.embeddings.index import ScopedIndex
from cachegw.embeddings.memo import PairScores, QueryVectors
from cachegw.gateway.cache.verifier_loader import load_verifier
from cachegw.gateway.config import load_settings
from cachegw.gateway.request.hits import hit_response
from cachegw.gateway.storage.store import Store, sql_stores
from cachegw.policies.pair_diff import align
from cachegw.policies.verifier import DecisionRule

QUESTIONS = [f"How do I reset my password for account type {i}?" for i in range(40)]
RETYPED = [q[0].lower() + q[1:] + " ?" for q in QUESTIONS]
TEXT = "Open Settings, choose Account, then Reset password and follow the link."
ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
          "choices": [{"index": 0, "finish_reason": "stop",
                       "message": {"role": "assistant", "content": TEXT}}],
          "usage": {"prompt_tokens": 20, "completion_tokens": 16, "total_tokens": 36}}  # fmt: skip


def timed(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    """p50 and min in ms over ``repeats`` calls, after a few unmeasured ones."""
    for _ in range(min(20, repeats)):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return {"p50_ms": round(statistics.median(times), 4), "min_ms": round(min(times), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    n = args.repeats
    s = load_settings(None)
    c = s.cache
    out: dict[str, dict[str, float]] = {}
    for threads in (1, 2):
        enc: Any = make_encoder("onnx", threads, None, s.engine.resolved_cache_dir)
        enc.encode(["warm up"])
        for size in (1, 2, 4, 8, 16, 32):
            name = f"encode {size}, {threads} thread{'s' if threads > 1 else ''}"
            texts = RETYPED[:size]

            def encode(enc: Any = enc, texts: list[str] = texts) -> object:
                return enc.encode(texts)

            out[name] = timed(encode, max(10, n // size))
            say(f"{name}: {out[name]}")
    enc = make_encoder("onnx", 1, None, s.engine.resolved_cache_dir)
    stored = enc.encode(QUESTIONS)
    vec = enc.encode([RETYPED[3]])[0]
    index = ScopedIndex(enc.dim)
    index.add("scope", np.arange(40, dtype=np.int64), stored)
    out["index search, 4 of 40"] = timed(lambda: index.search("scope", vec, k=4), n)
    out["alignment"] = timed(lambda: align(RETYPED[3], QUESTIONS[3]), n)
    verifier = load_verifier(c, s.engine.resolved_cache_dir)
    al = align(RETYPED[3], QUESTIONS[3])
    rule = DecisionRule(
        min_cosine=c.threshold, min_prob=c.verifier.threshold, sure=c.verifier.skip_cross_from
    )
    out["guards and MLP"] = timed(lambda: verifier.without_cross(al, vec[None], stored[3][None], rule), n)
    assert verifier.cross is not None
    cross = verifier.cross
    pair = ([RETYPED[3]], [QUESTIONS[3]])
    out["cross-encoder, one pair"] = timed(lambda: cross.score_batch(*pair), max(10, n // 3))
    scores = PairScores(cross, 16)
    scores.score_batch(*pair)
    out["cross-encoder score, kept"] = timed(lambda: scores.score_batch(*pair), n)
    with tempfile.TemporaryDirectory() as tmp:
        entries = sql_stores(Store(f"sqlite:///{Path(tmp) / 'c.db'}")).entries
        out["exact tier's database probe"] = timed(lambda: entries.find_exact("t", "m", "k", time.time()), n)

    async def memo_and_hop() -> None:
        batcher = EmbeddingBatcher(enc, window_ms=0.0)
        vectors = QueryVectors(batcher, 16)
        times = []
        for i in range(n):  # the thread hop of an encoder call, with the encoder's own time
            t = time.perf_counter()
            await batcher.embed(RETYPED[i % 40])
            times.append((time.perf_counter() - t) * 1e3)
        out["batcher embed, one text (with its thread hop)"] = {"p50_ms": round(statistics.median(times), 4)}
        await vectors.embed(RETYPED[3], "scope")
        times = []
        for _ in range(n):
            t = time.perf_counter()
            await vectors.embed(RETYPED[3], "scope")
            times.append((time.perf_counter() - t) * 1e3)
        out["query vector, kept"] = {"p50_ms": round(statistics.median(times), 4)}
        batcher.close()

    asyncio.run(memo_and_hop())
    raw = json.dumps(ANSWER)
    out["stored answer to response JSON"] = timed(
        lambda: json.dumps(hit_response(json.loads(raw), "req-1"), ensure_ascii=False).encode(), n
    )
    for k, v in out.items():
        say(f"{k}: {v}")
    save("hit_stages", {"repeats": n, "stages": out})


if __name__ == "__main__":
    main()
