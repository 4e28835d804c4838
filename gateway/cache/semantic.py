"""The semantic tier: a paraphrase within the same scope, found by meaning and then verified.

The last user message is embedded (concurrent requests share one encoder call), the scope's vector
index gives the nearest stored queries, and a candidate serves only if it is close enough
(``threshold_for``, and its own threshold learned from feedback), may serve this request
(``policies.cacheability.unservable``), and every difference between the two queries is accounted
for (``policies.pair_diff.align``, then the verifier on the differing part). With
``near_miss_links`` (static thresholds only), two candidates refused only by the verifier that an
audit linked serve the nearer (``gateway/cache/links.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np

from cachegw.embeddings.batcher import EmbeddingBatcher
from cachegw.embeddings.memo import MEMO_SCOPE, QueryVectors
from cachegw.gateway.cache.error_control import ScopeLine, ThresholdProvider
from cachegw.gateway.cache.lookup import Lookup
from cachegw.gateway.cache.memo import EntryMemo
from cachegw.gateway.config import CacheConfig
from cachegw.gateway.storage.interfaces import VectorIndex
from cachegw.gateway.storage.request_record import CacheResult
from cachegw.gateway.storage.tables import CacheEntry
from cachegw.policies.cache_keys import RequestKeys
from cachegw.policies.cacheability import Freshness, unservable
from cachegw.policies.error_bound import GRID
from cachegw.policies.pair_diff import align
from cachegw.policies.verifier import DecisionRule, Verifier

CANDIDATES = 4  # nearest neighbours checked per semantic lookup


class SemanticTier:
    def __init__(
        self,
        settings: Callable[[], CacheConfig],
        index: VectorIndex,
        batcher: EmbeddingBatcher | None,
        verifier: Verifier | None,
        memo: EntryMemo,
        lines: ThresholdProvider | None = None,
    ) -> None:
        """``lines`` gives each scope's false-hit-bound line (None: static thresholds only); the vectors
        of recent query texts are kept (``[cache] model_memo_entries``, embeddings/memo.py)."""
        self.settings = settings
        self.lines = lines
        self.index = index
        self.batcher = batcher
        self.vectors = QueryVectors(batcher, settings().model_memo_entries) if batcher is not None else None
        self.verifier = verifier
        self.memo = memo

    def threshold_for(self, model: str, tenant_name: str) -> float:
        """The similarity a paraphrase needs: per-tenant over per-model over the global threshold."""
        c = self.settings()
        return c.thresholds_by_tenant.get(tenant_name, c.thresholds_by_model.get(model, c.threshold))

    async def embed(self, text: str, scope: str) -> np.ndarray | None:
        return await self.vectors.embed(text, scope) if self.vectors is not None else None

    async def lookup(
        self,
        tenant_name: str,
        model: str,
        keys: RequestKeys,
        now: float,
        fresh: Freshness,
        max_rate: float | None = None,
    ) -> Lookup:
        """The nearest servable paraphrase in the request's scope (``keys.scope`` and ``keys.query``
        set, and a batcher: the caller checks), or a miss saying why the nearest was refused.
        ``max_rate``: the request's own false-hit target, tightening (or setting) its scope's."""
        assert self.vectors is not None and keys.scope and keys.query
        t_embed = time.perf_counter()
        MEMO_SCOPE.set(keys.scope)  # the cross-encoder's kept scores are this scope's (embeddings/memo.py)
        vec = await self.vectors.embed(keys.query, keys.scope)
        embed_ms = (time.perf_counter() - t_embed) * 1e3
        threshold = self.threshold_for(model, tenant_name)
        c = self.settings()
        line = self.lines.line(model, tenant_name, c, max_rate) if self.lines else None  # None: static
        # with the verifier off the bound's line is on the cosine itself: candidates from the grid's floor
        floor = threshold if line is None or c.verifier.enabled else min(threshold, GRID[0])
        hits = self.index.search(keys.scope, vec, k=CANDIDATES)
        result = Lookup(
            CacheResult.MISS,
            similarity=hits[0][1] if hits else None,
            threshold=threshold,
            embedding=vec,
            embed_ms=embed_ms,
            scope_line=line,
        )
        close = [(i, s) for i, s in hits if s >= floor]
        if hits and not close:
            result.reason = "below-threshold"
        if not close:
            return result
        refused: list[str] = []  # why each candidate, nearest first, was not served
        soft: list[tuple[CacheEntry, float, float]] = []  # refused only by the verifier or the line
        links = c.near_miss_links and line is None and self.lines is not None
        entries = await self.memo.get([i for i, _ in close])
        for entry_id, sim in close:
            entry = entries.get(entry_id)
            if entry is None or entry.scope != keys.scope:
                refused.append("not-servable")
                continue
            result.refused = result.refused or entry
            why_not = unservable(entry, keys.max_tokens, now, fresh)
            if why_not is not None:
                refused.append(why_not)
                continue
            if entry.threshold is not None and sim < entry.threshold:  # learned from feedback
                refused.append("entry-threshold")
                continue
            why, score = await self._refusal(keys.query, vec, entry, threshold, sim, line)
            if why is None:
                result.result, result.entry, result.similarity = CacheResult.SEMANTIC_HIT, entry, sim
                result.reason, result.score = "semantic", score
                return result
            if why == "error-bound" or (why == "verifier" and links):
                soft.append((entry, sim, score))
                if result.near is None:
                    result.near, result.score = entry, score
            refused.append(why)
        result.reason = refused[0]
        if links and (found := self._linked(soft)) is not None:
            result.result, result.entry, result.similarity, result.score = CacheResult.SEMANTIC_HIT, *found
            result.reason, result.near = "link", None
        return result

    def _linked(self, soft: list[tuple[CacheEntry, float, float]]) -> tuple[CacheEntry, float, float] | None:
        """The nearer end of the first link among the softly refused candidates (gateway/cache/links.py):
        the request sits between two entries an audit found to share one answer."""
        assert self.lines is not None
        for i, (a, _, _) in enumerate(soft):
            for b, _, _ in soft[i + 1 :]:
                if a.id is not None and b.id is not None and a.scope == b.scope:
                    if self.lines.links.linked(a.id, b.id):
                        return soft[i]
        return None

    async def _refusal(
        self,
        query: str,
        vec: np.ndarray,
        entry: CacheEntry,
        threshold: float,
        sim: float,
        line: ScopeLine | None,
    ) -> tuple[str | None, float]:
        """Why the candidate may not answer this query (None: it may), and its score. The two texts
        are aligned first (microseconds): material around the question must be identical and code,
        opposites and units in the differing spans refuse outright. The verifier then judges the
        differing part; when that is not the whole text (a question under a document), it is embedded
        alone, both sides in one encoder call. With a false-hit target the scope's line decides on the
        score instead of the static ``verifier_threshold`` (or cosine threshold, verifier off)."""

        def by_line(score: float) -> tuple[str | None, float]:
            return (None if line is None or line.serves(score, entry.id) else "error-bound"), score

        al = align(query, entry.query_text)
        if al.outcome != "judge":
            return by_line(1.0) if al.outcome == "same" else (al.reason, 0.0)
        c = self.settings()
        if not c.verifier.enabled or self.verifier is None or entry.embedding is None:
            return by_line(sim)
        if al.reembed and self.vectors is not None:
            emb = await self.vectors.embed_many([al.focus_new, al.focus_old], entry.scope)
            u, v = emb[0], emb[1]
        else:
            u, v = vec, np.frombuffer(entry.embedding, dtype=np.float32)
        min_prob = c.verifier.threshold if line is None else 0.0  # the line judges the prob
        rule = DecisionRule(min_cosine=threshold, min_prob=min_prob, sure=c.verifier.skip_cross_from)
        args = (al, u[None], v[None], rule)
        verdict = self.verifier.without_cross(*args)  # the MLP (~0.1 ms): not worth a thread hop
        if verdict is None:  # the cross-encoder (~3 ms) runs off the event loop; ORT releases the GIL
            verdict = await asyncio.to_thread(self.verifier.check_aligned, *args)
        if verdict.accepted:
            return by_line(verdict.prob)
        # the verifier's own cosine floor counts as its no: the entry was close enough to be a candidate
        return ("verifier" if verdict.reason in ("low_cosine", "low_prob") else verdict.reason), verdict.prob
