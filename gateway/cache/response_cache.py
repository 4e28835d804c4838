"""The two-tier response cache: exact repeats, then paraphrases within the same scope.

This is the facade the gateway uses; each job is its own module: the exact tier
(``exact.py``), the semantic tier (``semantic.py``), budgets, expiry and hit counts
(``maintenance.py``) and replica sync (``sync.py``); what may be stored or served is
``policies.cacheability``. Every part reads its settings from one provider, so a run-time change
applies to the next request.

The database is the source of truth: an entry is committed before it enters the in-memory views
(exact keys, vector index, memo) and removed from them after it leaves the database, and the views
are rebuilt from the database on start, so a crash can lose an index entry but never serve a
deleted one. The stores and the index are reached through their interfaces
(``gateway/storage/interfaces.py``), whichever implementation ``gateway/compose.py`` picked.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cachegw.embeddings.batcher import EmbeddingBatcher
from cachegw.gateway.cache.error_control import ThresholdProvider
from cachegw.gateway.cache.exact import ExactTier
from cachegw.gateway.cache.locks import KeyedLocks
from cachegw.gateway.cache.lookup import Lookup
from cachegw.gateway.cache.maintenance import Maintenance
from cachegw.gateway.cache.memo import EntryMemo
from cachegw.gateway.cache.semantic import SemanticTier
from cachegw.gateway.cache.sync import ReplicaSync
from cachegw.gateway.config import CacheConfig
from cachegw.gateway.storage.interfaces import CacheStores, VectorIndex
from cachegw.gateway.storage.request_record import CacheResult
from cachegw.gateway.storage.tables import CacheEntry
from cachegw.policies.cache_keys import RequestKeys
from cachegw.policies.cacheability import ANY_AGE, Freshness, answer_length, judge_answer
from cachegw.policies.pair_diff import warm as warm_alignment
from cachegw.policies.verifier import Verifier


class ResponseCache:
    def __init__(
        self,
        settings: CacheConfig | Callable[[], CacheConfig],
        stores: CacheStores,
        index: VectorIndex,
        batcher: EmbeddingBatcher | None,
        verifier: Verifier | None,
        lines: ThresholdProvider | None = None,
    ) -> None:
        """``settings`` gives the [cache] settings in force (a fixed ``CacheConfig`` for tools and
        tests); ``stores.entries.clock`` is the wall clock of expiry, freshness and sync; ``lines``
        each scope's false-hit-bound line (``gateway/cache/error_control.py``; None: static
        thresholds only)."""
        self.settings: Callable[[], CacheConfig] = (
            settings if callable(settings) else lambda: settings  # type: ignore[return-value]
        )
        self.entry_store = stores.entries
        self.index = index
        self.clock = self.entry_store.clock
        self.memo = EntryMemo(self.entry_store)
        self.exact = ExactTier(self.entry_store, self.memo, self.settings().exact_keys_in_memory)
        self.semantic = SemanticTier(self.settings, index, batcher, verifier, self.memo, lines)
        self.maintenance = Maintenance(self.settings, stores, self._forget)
        self.replicas = ReplicaSync(
            self.entry_store,
            stores.changes,
            self.exact,
            self.memo,
            index,
            self.maintenance,
            self._forget,
            self._reload,
        )
        self._storing = KeyedLocks()  # one insert per exact key at a time: its replace is seen whole
        if self.settings().semantic:
            warm_alignment()

    @property
    def lines(self) -> ThresholdProvider | None:
        """Each scope's false-hit-bound line (the stats read it), as the semantic tier holds it."""
        return self.semantic.lines

    @property
    def entries(self) -> int:
        return self.maintenance.totals.entries

    @property
    def bytes(self) -> int:
        return self.maintenance.totals.bytes

    @property
    def synced_at(self) -> float:
        """Wall-clock time of the last successful ``sync`` (a metric only)."""
        return self.replicas.synced_at

    def threshold(self, model: str, tenant_name: str) -> float:
        return self.semantic.threshold_for(model, tenant_name)

    def rebuild_index(self, progress: bool = True) -> int:
        """Load the in-memory views (exact keys, vector index) from the database, and follow the
        change log from just before (on start, and when this replica fell behind the pruned log)."""
        self.replicas.restart()
        self.memo.clear()
        self.exact.rebuild()
        total = self.entry_store.count_embeddings()
        self.index.rebuild(self.entry_store.iter_embeddings(), total=total, progress=progress)
        return len(self.index)

    def _reload(self) -> None:
        self.rebuild_index(progress=False)

    async def lookup(
        self,
        tenant: str,
        tenant_name: str,
        model: str,
        keys: RequestKeys,
        semantic: bool = True,
        fresh: Freshness = ANY_AGE,
        max_rate: float | None = None,
    ) -> Lookup:
        """Exact, then semantic; ``max_rate``: the request's own false-hit target (tightens only)."""
        start = time.perf_counter()
        now = self.clock()
        c = self.settings()
        if c.exact:
            entry = await self.exact.find(tenant, model, keys, now, fresh)
            if entry is not None:
                return Lookup(CacheResult.EXACT_HIT, entry, 1.0, lookup_ms=_ms(start), reason="exact")
        if not (c.semantic and semantic and keys.scope and keys.query and self.semantic.batcher):
            return Lookup(CacheResult.MISS, lookup_ms=_ms(start), reason="exact-only")
        result = await self.semantic.lookup(tenant_name, model, keys, now, fresh, max_rate)
        result.lookup_ms = _ms(start)
        return result

    async def insert(
        self,
        tenant: str,
        model: str,
        endpoint: str,
        keys: RequestKeys,
        embedding: np.ndarray | None,
        response: dict,
        ttl_seconds: int,
        replies: dict[str, str] | None = None,
    ) -> int | None:
        """Store a completed answer, with ``replies`` (``ReplyStore.remember_replies``) in the same commit;
        returns its entry id (None if it may not be stored, and then nothing is written)."""
        verdict = judge_answer(response, keys.max_tokens)
        if not verdict.store:
            return None
        finish = response["choices"][0]["finish_reason"]
        scope = keys.scope if verdict.semantic else None  # a tool call: exact repeats only
        if scope is None:
            embedding = None
        elif keys.query and embedding is None:
            embedding = await self.semantic.embed(keys.query, scope)
        usage = response.get("usage") or {}
        entry = self._entry(
            tenant,
            model,
            endpoint,
            keys,
            response,
            ttl_seconds,
            scope=scope or "",
            query_text=keys.query or "",
            finish_reason=finish,
            max_tokens=keys.max_tokens,
            embedding=None if embedding is None or not scope else embedding.astype(np.float32).tobytes(),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=answer_length(usage, keys.max_tokens, finish),
        )
        return await self._put(entry, keys, embedding, replies)

    async def insert_exact(
        self,
        tenant: str,
        model: str,
        endpoint: str,
        keys: RequestKeys,
        response: dict,
        ttl_seconds: int,
        query_text: str = "",
    ) -> int:
        """Store an answer that only an exact repeat may be served (one input's embedding): no
        judging of choices, no vector, finish "stop"; ``query_text`` is what the dashboard shows of
        the request. Returns its entry id."""
        entry = self._entry(tenant, model, endpoint, keys, response, ttl_seconds, query_text=query_text)
        return await self._put(entry, keys, None, None)

    def _entry(
        self,
        tenant: str,
        model: str,
        endpoint: str,
        keys: RequestKeys,
        response: dict,
        ttl_seconds: int,
        **fields: Any,
    ) -> CacheEntry:
        """A new entry for ``keys``' answer, stored from now for ``ttl_seconds``; ``fields`` over the
        defaults of an exact-only answer (no scope, no vector, finish "stop", no token counts)."""
        body = json.dumps(response, ensure_ascii=False)
        now = self.clock()
        values: dict[str, Any] = {
            "scope": "",
            "query_text": "",
            "finish_reason": "stop",
            "max_tokens": None,
            "embedding": None,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            **fields,
        }
        return CacheEntry(
            tenant=tenant,
            model=model,
            endpoint=endpoint,
            exact_key=keys.exact,
            response=body,
            size_bytes=len(body.encode()),
            created_at=now,
            expires_at=now + ttl_seconds,
            **values,
        )

    async def _put(
        self,
        entry: CacheEntry,
        keys: RequestKeys,
        embedding: np.ndarray | None,
        replies: dict[str, str] | None,
    ) -> int:
        """Commit the entry as its key's one live answer, then bring every view and the totals along."""
        scope = entry.scope
        async with self._storing.hold(keys.exact):
            entry_id, replaced = await asyncio.to_thread(self.entry_store.put_entry, entry, replies)
            # the key's earlier answer is gone from the database: from every view here too (only what
            # this replica counted is uncounted; ``sync`` never sees these ids again)
            known = [(i, size) for i, size in replaced if i in self.exact]
            self._forget([i for i, _ in replaced])
            self.memo.remember(entry)
            self.exact.add(keys.exact, entry_id)
            if entry.embedding is not None and embedding is not None and scope and entry_id not in self.index:
                # ``sync`` may have been first
                self.index.add(
                    scope, np.array([entry_id], dtype=np.int64), embedding[None].astype(np.float32)
                )
        totals = self.maintenance.totals
        totals.entries += 1 - len(known)
        totals.bytes += entry.size_bytes - sum(size for _, size in known)
        if totals.over(self.settings()):
            await self.evict()
        return entry_id

    async def flag_bad(
        self, entry_id: int, similarity: float | None, whole_entry: bool
    ) -> tuple[CacheEntry, str] | None:
        """Act on a hit reported bad; returns the entry and what was done (None: no such entry).

        ``whole_entry``: the answer is wrong for its own query (an exact hit, or a stored miss): it is
        never served again. Otherwise a paraphrase got an answer that does not fit it: the entry's own
        threshold rises above that similarity, so this query and anything further away stop hitting
        while closer paraphrases still do.
        """
        # from the database, not the memo: another replica may have deleted or flagged it
        entry = (await asyncio.to_thread(self.entry_store.get_entries, [entry_id])).get(entry_id)
        if entry is None:
            return None
        self.memo.remember(entry)  # replaces a stale memo copy; updated below with the database
        if whole_entry or similarity is None:
            await asyncio.to_thread(self.entry_store.mark_bad, entry_id)
            entry.bad = True
            self.index.remove([entry_id])
            self.exact.drop(entry_id)
            return entry, "entry marked bad: never served again"
        # capped at 1: a paraphrase flagged that close leaves the entry to its own exact repeats
        margin = self.settings().feedback_margin
        threshold = min(1.0, max(entry.threshold or 0.0, similarity + margin))
        await asyncio.to_thread(self.entry_store.set_entry_threshold, entry_id, threshold)
        entry.threshold = threshold
        return entry, f"entry threshold raised to {threshold:.4f}"

    def _forget(self, ids: list[int]) -> None:
        """Drop entries from every in-memory view (the database is handled by the caller)."""
        self.index.remove(ids)
        self.maintenance.drop_hits(ids)
        for i in ids:
            self.memo.forget(i)
            self.exact.drop(i)

    # the other jobs, as the rest of the gateway calls them

    def record_hit(self, entry: CacheEntry) -> None:
        self.maintenance.record_hit(entry.id)

    async def flush_hits(self) -> None:
        await self.maintenance.flush_hits()

    async def delete(self, ids: list[int]) -> int:
        return await self.maintenance.delete(ids)

    async def evict(self) -> int:
        return await self.maintenance.evict()

    async def expire(self) -> int:
        return await self.maintenance.expire()

    async def sync(self) -> int:
        return await self.replicas.sync()


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
