"""Recent model outputs kept by their exact input: a query's vector, a pair's cross-encoder score.

A semantic hit's time is mostly its two models: the query embedding (about 3.5 ms of one core for a short
question, the same per text whether batched or not: a MiniLM call is compute-bound) and, for a pair the
MLP is not sure of, the cross-encoder (about 4.5 ms). A question asked again in the same words (a popular
paraphrase, a retried request) would run both again for the same result. Each model's output is a
function of its input text alone, so it is kept here, per semantic scope (which names the tenant: no
one's hit is faster for what another tenant asked), least recently used dropped first, and a repeat asks
no model: its hit then costs what an exact hit does plus the index search, the alignment, the guards and
the MLP (well under a millisecond). Verdicts are the same: the verifier sees the same vector and the same
score it would have computed (a vector to within the 1e-5 by which batching already moves it).

``[cache] model_memo_entries`` bounds each memo (0: off). A vector costs 1.5 KiB, a score a few bytes
beside its two texts.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Protocol

import numpy as np

from cachegw.configtools.lru import Lru
from cachegw.embeddings.batcher import EmbeddingBatcher


class PairScorer(Protocol):
    """A model that scores pairs of texts (the cross-encoder; policies.verifier.PairScorer's shape)."""

    def score_batch(self, q_new: list[str], q_old: list[str]) -> np.ndarray: ...


class QueryVectors:
    """The batcher's ``embed`` and ``embed_many`` with the vectors of recent texts kept (event loop only).

    Kept per ``scope`` (the request's semantic scope, which names its tenant): a repeat is only ever
    faster for the tenant who asked first, so the time of a hit tells no one what another tenant asked.
    """

    def __init__(self, batcher: EmbeddingBatcher, size: int) -> None:
        self.batcher = batcher
        self.memo: Lru[tuple[str, str], np.ndarray] = Lru(size)

    async def embed(self, text: str, scope: str) -> np.ndarray:
        vec = self.memo.get((scope, text))
        if vec is None:
            vec = await self.batcher.embed(text)
            vec.flags.writeable = False  # shared by every later hit of the text
            self.memo[scope, text] = vec
        return vec

    async def embed_many(self, texts: Sequence[str], scope: str) -> np.ndarray:
        found = {t: v for t in texts if (v := self.memo.get((scope, t))) is not None}
        missing = [t for t in dict.fromkeys(texts) if t not in found]
        if missing:
            for t, v in zip(missing, await self.batcher.embed_many(missing), strict=True):
                v.flags.writeable = False
                found[t] = v
                self.memo[scope, t] = v
        return np.stack([found[t] for t in texts]) if texts else await self.batcher.embed_many([])


# The semantic scope a pair is scored for: set by the request's lookup, read in the worker thread that
# runs the cross-encoder (``asyncio.to_thread`` carries the context over), so scores are kept per tenant.
MEMO_SCOPE: ContextVar[str] = ContextVar("cachegw_memo_scope", default="")


class PairScores:
    """A ``PairScorer`` (the cross-encoder) whose scores of recent pairs are kept, per ``MEMO_SCOPE``.

    Called from worker threads (the cross-encoder runs off the event loop), so the memo is read and
    written under a lock, never held while the model runs: two threads scoring the same new pair at once
    both run it and keep the same score.
    """

    def __init__(self, scorer: PairScorer, size: int) -> None:
        self.scorer = scorer
        self.memo: Lru[tuple[str, str, str], float] = Lru(size)
        self._lock = threading.Lock()

    def score_batch(self, q_new: list[str], q_old: list[str]) -> np.ndarray:
        scope = MEMO_SCOPE.get()
        pairs = [(scope, a, b) for a, b in zip(q_new, q_old, strict=True)]
        with self._lock:
            found = {p: s for p in pairs if (s := self.memo.get(p)) is not None}
        missing = [p for p in dict.fromkeys(pairs) if p not in found]
        if missing:
            fresh = self.scorer.score_batch([a for _, a, _ in missing], [b for _, _, b in missing])
            with self._lock:
                for p, score in zip(missing, fresh, strict=True):
                    found[p] = float(score)
                    self.memo[p] = found[p]
        return np.array([found[p] for p in pairs], dtype=np.float32)
