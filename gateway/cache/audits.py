"""Audits: after the client has its answer, a sampled share of semantic hits and near misses is
checked, and the verdict becomes false-hit evidence (``gateway/cache/error_control.py``).

A hit is re-asked to the backend by the gateway itself (its canonical body, without streaming, at low
priority: ``[cache] audit_priority``, which the built-in engine's scheduler honours) and
the fresh answer is compared with the stored one that was served. A near miss (a candidate only the
error-bound line refused) needs no extra request: the client's own fresh answer is compared with the
candidate's stored one. That is how evidence grows while a scope serves no hits yet.

Nothing here is on the request path: ``offer`` samples, takes a token from the budget's bucket and
puts the job on a bounded queue without waiting (over budget or queue full: dropped and counted);
one worker task does the rest.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from cachetools import FIFOCache

from cachegw.embeddings.batcher import EmbeddingBatcher
from cachegw.gateway.cache.error_control import ThresholdProvider
from cachegw.gateway.config import CacheConfig
from cachegw.gateway.storage.evidence_store import EvidenceRow
from cachegw.gateway.storage.tables import CacheEntry
from cachegw.gateway.upstream.proxy import Backends

log = logging.getLogger("cachegw.gateway")
QUEUE = 256  # audits waiting for the worker; more are dropped
RECENT = 10_000  # hits whose score a bad-hit report can still find


@dataclass(frozen=True)
class AuditJob:
    kind: Literal["hit", "near-miss"]
    model: str
    tenant: str  # name, as the thresholds and evidence name it
    score: float
    entry: CacheEntry  # the stored answer served (hit) or refused by the line (near miss)
    request_id: str
    endpoint: str  # "chat" | "completions"
    body: dict[str, Any]  # canonical, as a miss would have been forwarded
    cache_salt: str | None = None
    fresh: dict[str, Any] | None = None  # the client's fresh answer (near miss)
    stored_entry_id: int | None = None  # the near-miss request's own stored entry: linked when right


class TokenBucket:
    """``rate`` tokens a second, a burst of ``max(1, rate)``; ``take`` never waits."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.clock = rate, clock
        self.tokens, self.at = max(1.0, rate), clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(max(1.0, self.rate), self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.rate > 0 and self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


def answer_text(response: dict[str, Any], endpoint: str) -> str:
    """What is compared of an answer: its text, and its tool calls' names and arguments."""
    choice = (response.get("choices") or [{}])[0]
    if endpoint != "chat":
        return str(choice.get("text") or "")
    message = choice.get("message") or {}
    calls = [
        (c.get("function") or {}).get("name", "") + json.dumps((c.get("function") or {}).get("arguments", ""))
        for c in message.get("tool_calls") or []
    ]
    return str(message.get("content") or "") + "".join(calls)


class Auditor:
    def __init__(
        self,
        lines: ThresholdProvider,
        backends: Backends,
        batcher: EmbeddingBatcher | None,
        config: Callable[[], CacheConfig],
        clock: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
        builtin_backend: bool = False,
    ) -> None:
        self.lines, self.backends, self.batcher = lines, backends, batcher
        self.builtin_backend = builtin_backend  # the built-in engine answers: it honours `priority`
        self.config, self.clock, self.rng = config, clock, rng
        self.bucket = TokenBucket(config().audits.max_per_second)
        self.queue: asyncio.Queue[AuditJob] = asyncio.Queue(maxsize=QUEUE)
        self.counts: Counter[str] = Counter()  # right | wrong | failed | dropped
        self.backend_tokens = 0  # spent by this replica's re-asks
        self.backend_requests = 0  # this replica's re-asks (near misses need none)
        # the last RECENT hits by request id (ids are unique: first in, first out)
        self._recent: FIFOCache[str, tuple[str, str, float, int | None]] = FIFOCache(RECENT)

    def offer(self, job: AuditJob) -> str:
        """Sample, budget, enqueue: never waits. Returns what happened (for tests and logs)."""
        c = self.config()
        if job.kind == "hit":
            self._recent[job.request_id] = (job.model, job.tenant, job.score, job.entry.id)
        # a near miss costs no backend request: with links on, every one is compared (within the budget)
        fraction = 1.0 if job.kind == "near-miss" and c.near_miss_links else c.audits.fraction
        if fraction <= 0 or self.rng() >= fraction:
            return "sampled-out"
        self.bucket.rate = c.audits.max_per_second  # live settings may change it
        if not self.bucket.take():
            self.counts["dropped"] += 1
            return "over-budget"
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            self.counts["dropped"] += 1
            return "queue-full"
        return "queued"

    async def run(self) -> None:
        """The worker: one audit at a time, each failure logged and counted."""
        while True:
            job = await self.queue.get()
            try:
                await self.audit(job)
            except Exception:
                self.counts["failed"] += 1
                log.exception("audit of %s failed", job.request_id)
            finally:
                self.queue.task_done()

    async def audit(self, job: AuditJob) -> bool:
        """Decide whether the stored answer was right for the new query; record it as evidence."""
        tokens = 0
        fresh = job.fresh
        if fresh is None:
            fresh, tokens = await self._reask(job)
        right = await self.same_answer(
            answer_text(fresh, job.endpoint), answer_text(_stored(job), job.endpoint)
        )
        self.counts["right" if right else "wrong"] += 1
        self.backend_tokens += tokens
        row = EvidenceRow(
            job.model,
            job.tenant,
            job.score,
            right,
            job.kind,
            self.clock(),
            job.entry.id,
            job.request_id,
            tokens,
            linked_entry_id=job.stored_entry_id if job.kind == "near-miss" else None,
        )
        await self.lines.record([row])
        return right

    def reask_body(self, job: AuditJob) -> dict[str, Any]:
        """The request as a miss would have sent it, not streamed, at the audits' low priority where
        the backend honours one (``audit_send_priority``)."""
        body = {k: v for k, v in job.body.items() if k not in ("stream", "stream_options")}
        c = self.config()
        if c.audits.send_priority == "always" or (c.audits.send_priority == "auto" and self.builtin_backend):
            body["priority"] = c.audits.priority
        return body

    async def _reask(self, job: AuditJob) -> tuple[dict[str, Any], int]:
        body = self.reask_body(job)
        urls = self.backends.order(await self.backends.route(job.model or None), job.endpoint, body)
        path = "/chat/completions" if job.endpoint == "chat" else "/completions"
        self.backend_requests += 1
        # the audited request's id, marked: the backend's logs tell audits from the clients' requests
        audit_id = {"x-request-id": f"{job.request_id}-audit"}
        status, data, _, _ = await self.backends.post_json(urls, path, body, job.cache_salt, None, audit_id)
        if status != 200:
            raise RuntimeError(f"the backend answered the audit with {status}")
        usage = data.get("usage") or {}
        tokens = int(usage.get("total_tokens") or 0) or int(usage.get("prompt_tokens") or 0) + int(
            usage.get("completion_tokens") or 0
        )
        return data, tokens

    async def same_answer(self, a: str, b: str) -> bool:
        """Identical up to whitespace: the same answer; else, below ``audit_answer_cosine`` 1.0, the
        answers' embeddings decide (off by default: on a small model it hid false hits)."""
        if " ".join(a.split()) == " ".join(b.split()):
            return True
        least = self.config().audits.answer_cosine
        if least >= 1.0 or self.batcher is None or not a.strip() or not b.strip():
            return False
        emb = await self.batcher.embed_many([a, b])
        return float(np.dot(emb[0], emb[1])) >= least

    async def bad_report(self, request_id: str) -> bool:
        """A user's bad-hit report on a semantic hit is wrong-verdict evidence at the hit's score, for
        its scope and its entry (remembered for this replica's last ``RECENT`` hits; older reports
        only act on the entry)."""
        found = self._recent.get(request_id)
        if found is None:
            return False
        model, tenant, score, entry_id = found
        row = EvidenceRow(model, tenant, score, False, "feedback", self.clock(), entry_id, request_id)
        await self.lines.record([row])
        return True


def _stored(job: AuditJob) -> dict[str, Any]:
    return json.loads(job.entry.response)
