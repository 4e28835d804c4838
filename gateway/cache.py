"""The two-tier response cache: exact repeats, then paraphrases within the same scope.

A stored answer is served only if it completed well (finish_reason "stop" or "tool_calls" within
the new request's max_tokens, or "length" at exactly the same max_tokens; what may be stored at all
is ``policies.cacheability.judge_answer``), has not expired and was not
flagged bad. The database is the source of truth: an entry is committed before it enters the
FAISS index and removed from the index after it leaves the database, and the index is rebuilt
from the database on start, so a crash can lose an index entry but never serve a deleted one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from embeddings.batcher import EmbeddingBatcher
from embeddings.index import ScopedIndex
from gateway.cache_keys import RequestKeys
from gateway.config import CacheConfig
from gateway.error_control import ScopeLine, ThresholdProvider
from gateway.keyed_locks import KeyedLocks
from gateway.store import Store
from gateway.tables import CacheEntry
from policies.cacheability import ANY_AGE, Freshness, judge_answer
from policies.error_bound import GRID
from policies.pair_diff import align
from policies.pair_diff import warm as warm_alignment
from policies.verifier import DecisionRule, Verifier

log = logging.getLogger("cachegw.gateway")

CANDIDATES = 4  # nearest neighbours checked per semantic lookup
MEMO_ENTRIES = 10_000  # entries kept in memory
HIT_FLUSH_S = 1.0  # how often hit counts reach the database
SYNC_OVERLAP_S = 60.0  # how far back each sync looks again: late commits, replica clocks that differ
DELETION_LOG_S = 3600.0  # deleted ids are kept this long for other replicas' syncs to see


@dataclass
class Lookup:
    """What the cache found. ``reason`` says why (the x-cache-reason header): ``exact`` and
    ``semantic`` for hits; for a miss, why the nearest candidate was refused: ``no-candidate`` (the
    scope holds nothing), ``below-threshold``, what kept the nearest stored answer from serving
    (``expired``, ``flagged``, ``too-old`` for the request's max-age, ``too-long`` for its max_tokens,
    ``truncated`` at another max_tokens, ``not-servable`` otherwise), ``entry-threshold`` (its own
    threshold, raised by feedback), what the alignment of the two queries found (``context-differs``:
    a document, quote or code around the question differs; ``guard:code``, ``guard:polarity``,
    ``guard:units``, ``guard:numbers`` and the verifier's other guards), ``verifier`` (the learned
    verifier said no to the differing part), ``error-bound`` (its score is under the line the scope's
    false-hit target allows, ``gateway/error_control.py``), or ``exact-only`` (no semantic lookup).

    ``score`` is what the serving decision thresholded on (the verifier's probability, or the cosine
    with the verifier off) for the hit, or for ``near``: the nearest candidate only the error-bound line
    refused (a near miss the audits may compare with the fresh answer)."""

    result: str  # "exact-hit" | "semantic-hit" | "miss"
    entry: CacheEntry | None = None
    similarity: float | None = None  # of the hit, or of the nearest neighbour on a miss
    threshold: float | None = None
    embedding: np.ndarray | None = None
    embed_ms: float | None = None
    lookup_ms: float = 0.0
    reason: str = "no-candidate"
    score: float | None = None
    near: CacheEntry | None = None
    scope_line: ScopeLine | None = None


UNKNOWN_LENGTH = 2**31 - 1  # completion_tokens of an answer stored without usage: no limit is known to hold


def unservable(entry: CacheEntry, keys: RequestKeys, now: float, fresh: Freshness = ANY_AGE) -> str | None:
    """Why a stored answer may not answer this request (a miss reason), or None when it may."""
    if entry.bad:
        return "flagged"
    if entry.expires_at <= now:
        return "expired"
    if entry.expires_at - fresh.min_fresh <= now or (
        fresh.max_age is not None and now - entry.created_at > fresh.max_age
    ):
        return "too-old"  # for the request's Cache-Control max-age / min-fresh
    if entry.finish_reason in ("stop", "tool_calls"):
        fits = keys.max_tokens is None or entry.completion_tokens <= keys.max_tokens
        return None if fits else "too-long"
    if entry.finish_reason == "length":  # truncated: only for exactly the same limit
        same = keys.max_tokens is not None and keys.max_tokens == entry.max_tokens
        return None if same else "truncated"
    return "not-servable"


def servable(entry: CacheEntry, keys: RequestKeys, now: float, fresh: Freshness = ANY_AGE) -> bool:
    return unservable(entry, keys, now, fresh) is None


class ResponseCache:
    def __init__(
        self,
        config: CacheConfig,
        store: Store,
        index: ScopedIndex,
        batcher: EmbeddingBatcher | None,
        verifier: Verifier | None,
    ) -> None:
        self.config = config
        self.store = store
        self.index = index
        self.batcher = batcher
        self.verifier = verifier
        self.clock = store.clock  # one wall clock for expiry, freshness and sync, given with the store
        self.entries, self.bytes = store.totals()
        self._evict_lock = asyncio.Lock()
        # Recently used entries are kept here to spare the database a query on every semantic hit;
        # they change only through ``flag_bad``, which updates both. The database stays the truth.
        self._memo: OrderedDict[int, CacheEntry] = OrderedDict()
        self._pending_hits: dict[int, tuple[int, float]] = {}
        # The exact tier mirrored in memory (exact key -> entry ids), so an exact hit needs no
        # query; a key it does not know is still looked up in the database (another replica's).
        self._exact: dict[str, list[int]] = {}
        self._exact_of: dict[int, str] = {}
        self._storing = KeyedLocks()  # one insert per exact key at a time: its replace is seen whole
        self.synced_at = self.clock()  # of the last successful ``sync`` (a metric)
        self.lines: ThresholdProvider | None = None  # the false-hit bound's lines, when serve.py gives it
        if config.semantic:
            warm_alignment()

    def threshold(self, model: str, tenant_name: str) -> float:
        """Per-tenant over per-model over the global threshold."""
        c = self.config
        return c.thresholds_by_tenant.get(tenant_name, c.thresholds_by_model.get(model, c.threshold))

    def _index_exact(self, key: str, entry_id: int) -> None:
        ids = self._exact.setdefault(key, [])
        if entry_id not in ids:
            ids.append(entry_id)
            self._exact_of[entry_id] = key

    def rebuild_index(self, progress: bool = True) -> int:
        """Load the in-memory views (exact keys, vector index) from the database."""
        self._exact.clear()
        self._exact_of.clear()
        for key, entry_id in self.store.exact_keys():
            self._index_exact(key, entry_id)
        total = self.store.count_embeddings()
        self.index.rebuild(self.store.iter_embeddings(), total=total, progress=progress)
        return len(self.index)

    async def lookup(
        self,
        tenant: str,
        tenant_name: str,
        model: str,
        keys: RequestKeys,
        semantic: bool = True,
        fresh: Freshness = ANY_AGE,
    ) -> Lookup:
        start = time.perf_counter()
        now = self.clock()
        c = self.config
        if c.exact:
            known = self._exact.get(keys.exact)
            found = await self._get_entries(list(known)) if known else {}
            if found:
                candidates = sorted(found.values(), key=lambda e: -e.id)
            else:  # unknown here, or replaced by another replica since the last sync
                candidates = await asyncio.to_thread(self.store.find_exact, tenant, model, keys.exact, now)
                for entry in candidates:
                    self._remember(entry)
                    self._index_exact(entry.exact_key, entry.id)
            for entry in candidates:
                if entry.tenant == tenant and entry.model == model and servable(entry, keys, now, fresh):
                    return Lookup("exact-hit", entry, 1.0, lookup_ms=_ms(start), reason="exact")
        if not (c.semantic and semantic and keys.scope and keys.query and self.batcher):
            return Lookup("miss", lookup_ms=_ms(start), reason="exact-only")
        t_embed = time.perf_counter()
        vec = await self.batcher.embed(keys.query)
        embed_ms = _ms(t_embed)
        threshold = self.threshold(model, tenant_name)
        line = self.lines.line(model, tenant_name, c) if self.lines else None  # None: static thresholds
        # with the verifier off the bound's line is on the cosine itself: candidates from the grid's floor
        floor = threshold if line is None or c.verifier else min(threshold, GRID[0])
        hits = self.index.search(keys.scope, vec, k=CANDIDATES)
        result = Lookup(
            "miss",
            similarity=hits[0][1] if hits else None,
            threshold=threshold,
            embedding=vec,
            embed_ms=embed_ms,
            scope_line=line,
        )
        close = [(i, s) for i, s in hits if s >= floor]
        if hits and not close:
            result.reason = "below-threshold"
        if close:
            refused: list[str] = []  # why each candidate, nearest first, was not served
            entries = await self._get_entries([i for i, _ in close])
            for entry_id, sim in close:
                entry = entries.get(entry_id)
                why_not = "not-servable" if entry is None or entry.scope != keys.scope else None
                why_not = why_not or unservable(entry, keys, now, fresh)  # type: ignore[arg-type]
                if why_not is not None:
                    refused.append(why_not)
                    continue
                if entry.threshold is not None and sim < entry.threshold:  # learned from feedback
                    refused.append("entry-threshold")
                    continue
                why, score = await self._refusal(keys.query, vec, entry, threshold, sim, line)
                if why is None:
                    result.result, result.entry, result.similarity = "semantic-hit", entry, sim
                    result.reason, result.score = "semantic", score
                    break
                if why == "error-bound" and result.near is None:
                    result.near, result.score = entry, score
                refused.append(why)
            else:
                result.reason = refused[0]
        result.lookup_ms = _ms(start)
        return result

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
            return (None if line is None or line.serves(score) else "error-bound"), score

        al = align(query, entry.query_text)
        if al.outcome != "judge":
            return by_line(1.0) if al.outcome == "same" else (al.reason, 0.0)
        if not self.config.verifier or self.verifier is None or entry.embedding is None:
            return by_line(sim)
        if al.reembed and self.batcher is not None:
            emb = await self.batcher.embed_many([al.focus_new, al.focus_old])
            u, v = emb[0], emb[1]
        else:
            u, v = vec, np.frombuffer(entry.embedding, dtype=np.float32)
        min_prob = self.config.verifier_threshold if line is None else 0.0  # the line judges the prob
        rule = DecisionRule(min_cosine=threshold, min_prob=min_prob)
        args = (al, u[None], v[None], rule)
        if self.verifier.cross is None:  # the MLP alone takes ~0.1 ms: not worth a thread hop
            verdict = self.verifier.check_aligned(*args)
        else:  # the cross-encoder (~2 ms) runs off the event loop; ORT releases the GIL
            verdict = await asyncio.to_thread(self.verifier.check_aligned, *args)
        if verdict.accepted:
            return by_line(verdict.prob)
        # the verifier's own cosine floor counts as its no: the entry was close enough to be a candidate
        return ("verifier" if verdict.reason in ("low_cosine", "low_prob") else verdict.reason), verdict.prob

    async def _get_entries(self, ids: list[int]) -> dict[int, CacheEntry]:
        found = {i: self._memo[i] for i in ids if i in self._memo}
        missing = [i for i in ids if i not in found]
        if missing:
            for entry_id, entry in (await asyncio.to_thread(self.store.get_entries, missing)).items():
                found[entry_id] = self._remember(entry)
        for i in found:
            self._memo.move_to_end(i)
        return found

    def _remember(self, entry: CacheEntry) -> CacheEntry:
        self._memo[entry.id] = entry
        if len(self._memo) > MEMO_ENTRIES:
            self._memo.popitem(last=False)
        return entry

    def record_hit(self, entry: CacheEntry) -> None:
        """Counted in memory; ``flush_hits`` writes the counts in one transaction."""
        n, _ = self._pending_hits.get(entry.id, (0, 0.0))
        self._pending_hits[entry.id] = (n + 1, self.clock())

    async def flush_hits(self) -> None:
        hits, self._pending_hits = self._pending_hits, {}
        await asyncio.to_thread(self.store.record_hits, hits)

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
        """Store a completed answer, with ``replies`` (Store.remember_replies) in the same commit;
        returns its entry id (None if it may not be stored, and then nothing is written)."""
        verdict = judge_answer(response, keys.max_tokens)
        if not verdict.store:
            return None
        finish = response["choices"][0]["finish_reason"]
        scope = keys.scope if verdict.semantic else None  # a tool call: exact repeats only
        if scope is None:
            embedding = None
        elif keys.query and embedding is None and self.batcher:
            embedding = await self.batcher.embed(keys.query)
        usage = response.get("usage") or {}
        body = json.dumps(response, ensure_ascii=False)
        now = self.clock()
        entry = CacheEntry(
            tenant=tenant,
            model=model,
            endpoint=endpoint,
            scope=scope or "",
            exact_key=keys.exact,
            query_text=keys.query or "",
            response=body,
            finish_reason=finish,
            max_tokens=keys.max_tokens,
            embedding=None if embedding is None or not scope else embedding.astype(np.float32).tobytes(),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=_completion_tokens(usage, keys, finish),
            size_bytes=len(body.encode()),
            created_at=now,
            expires_at=now + ttl_seconds,
        )
        async with self._storing.hold(keys.exact):
            entry_id, replaced = await asyncio.to_thread(self.store.put_entry, entry, replies)
            # the key's earlier answer is gone from the database: from every view here too (only what
            # this replica counted is uncounted; ``sync`` never sees these ids again)
            known = [(i, size) for i, size in replaced if i in self._exact_of]
            self._forget([i for i, _ in replaced])
            self._remember(entry)
            self._index_exact(keys.exact, entry_id)
            if entry.embedding is not None and embedding is not None and scope and entry_id not in self.index:
                # ``sync`` may have been first
                self.index.add(
                    scope, np.array([entry_id], dtype=np.int64), embedding[None].astype(np.float32)
                )
        self.entries += 1 - len(known)
        self.bytes += entry.size_bytes - sum(size for _, size in known)
        if self.entries > self.config.max_entries or self.bytes > self.config.max_bytes:
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
        entry = (await asyncio.to_thread(self.store.get_entries, [entry_id])).get(entry_id)
        if entry is None:
            return None
        self._remember(entry)  # replaces a stale memo copy; updated below with the database
        if whole_entry or similarity is None:
            await asyncio.to_thread(self.store.mark_bad, entry_id)
            entry.bad = True
            self.index.remove([entry_id])
            self._drop_exact(entry_id)
            return entry, "entry marked bad: never served again"
        # capped at 1: a paraphrase flagged that close leaves the entry to its own exact repeats
        threshold = min(1.0, max(entry.threshold or 0.0, similarity + self.config.feedback_margin))
        await asyncio.to_thread(self.store.set_entry_threshold, entry_id, threshold)
        entry.threshold = threshold
        return entry, f"entry threshold raised to {threshold:.4f}"

    async def sync(self) -> int:
        """Apply what other replicas on the same database did since the last call: entries they stored
        join the index and the exact tier, entries they flagged or re-thresholded are re-read, entries
        they deleted are dropped. Returns how many entries were added here or dropped.

        The window reaches ``SYNC_OVERLAP_S`` back, so a commit that landed late or a replica whose
        clock is behind is still seen; what is already known is skipped.
        """
        now = self.clock()
        changed, deleted = await asyncio.to_thread(self.store.changes_since, self.synced_at - SYNC_OVERLAP_S)
        self.synced_at = now
        # counters move by what others did: their deletions of entries known here, their new entries
        gone = [i for i, _ in deleted if i in self._exact_of or i in self.index or i in self._memo]
        freed = {i: size for i, size in deleted if i in self._exact_of}
        wanted = [i for i, updated in changed if updated or i not in self._exact_of]
        fresh = await asyncio.to_thread(self.store.get_entries, wanted) if wanted else {}
        added = 0
        for entry_id, entry in fresh.items():
            known = entry_id in self._exact_of
            if entry.bad:
                if known or entry_id in self._memo:
                    gone.append(entry_id)
                continue
            if entry_id in self._memo:
                self._memo[entry_id] = entry  # a learned threshold another replica set
            if not known:
                added += 1
                self.entries += 1
                self.bytes += entry.size_bytes
                self._index_exact(entry.exact_key, entry_id)
            if entry.embedding is not None and entry.scope and entry_id not in self.index:
                vec = np.frombuffer(entry.embedding, dtype=np.float32)[None]
                self.index.add(entry.scope, np.array([entry_id], dtype=np.int64), vec)
        self._forget(gone)
        self.entries -= len(freed)
        self.bytes -= sum(freed.values())
        return added + len(set(gone))

    def _forget(self, ids: list[int]) -> None:
        """Drop entries from every in-memory view (the database is handled by the caller)."""
        self.index.remove(ids)
        for i in ids:
            self._memo.pop(i, None)
            self._pending_hits.pop(i, None)
            self._drop_exact(i)

    def _drop_exact(self, entry_id: int) -> None:
        key = self._exact_of.pop(entry_id, None)
        if key is not None and entry_id in self._exact.get(key, []):
            self._exact[key].remove(entry_id)
            if not self._exact[key]:
                del self._exact[key]

    async def delete(self, ids: list[int]) -> int:
        """Remove entries from the database first, then from the index."""
        removed = await asyncio.to_thread(self.store.delete_entries, ids)
        self._forget(ids)
        self.entries, self.bytes = await asyncio.to_thread(self.store.totals)
        return removed

    async def evict(self) -> int:
        """Bring the cache back under its entry and byte budgets (LRU or LFU), down to 95% of them."""
        async with self._evict_lock:
            c = self.config
            over_n = self.entries - int(c.max_entries * 0.95)
            over_b = self.bytes - int(c.max_bytes * 0.95)
            if over_n <= 0 and over_b <= 0:
                return 0
            order = await asyncio.to_thread(self.store.eviction_order, c.eviction, max(over_n, 0) + 1000)
            victims, freed = [], 0
            for entry_id, size in order:
                if len(victims) >= over_n and freed >= over_b:
                    break
                victims.append(entry_id)
                freed += size
            removed = await self.delete(victims)
            log.info("evicted %d entries (%s)", removed, c.eviction)
            return removed

    async def expire(self) -> int:
        """Delete expired entries; also prunes the deletion log and old replies, and recounts the
        totals, which other replicas' inserts racing this one's can leave a little off."""
        now = self.clock()
        await asyncio.to_thread(self.store.prune_deletions, now - DELETION_LOG_S)
        # a conversation that comes back later than any entry can live loses only a prefix-cache hit
        await asyncio.to_thread(self.store.prune_replies, now - self.config.max_ttl_seconds)
        ids = await asyncio.to_thread(self.store.expired_ids, now)
        if ids:
            return await self.delete(ids)
        self.entries, self.bytes = await asyncio.to_thread(self.store.totals)
        return 0


def _completion_tokens(usage: dict, keys: RequestKeys, finish: str) -> int:
    """The answer's length, which decides which max_tokens it may be served to. A backend that sent no
    usage leaves only what its own limit proves: a "stop" (or "tool_calls") answer fit the max_tokens
    it was asked with."""
    n = usage.get("completion_tokens")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        return n
    ended = finish in ("stop", "tool_calls")
    return keys.max_tokens if keys.max_tokens is not None and ended else UNKNOWN_LENGTH


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
