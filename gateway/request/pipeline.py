"""The gateway's request pipeline. One direction: request -> policy -> cache -> canonicalize -> backend
-> record.

The cache keys are computed on the canonical form of the request, so requests that differ only
in whitespace, key order or Unicode form are exact repeats; the same canonical body is what the
backend receives, so its prefix cache sees byte-identical prefixes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cachegw.gateway.cache.audits import AuditJob, Auditor
from cachegw.gateway.cache.response_cache import ResponseCache
from cachegw.gateway.config import Settings
from cachegw.gateway.live_settings import LiveSettings
from cachegw.gateway.metrics import GatewayMetrics
from cachegw.gateway.request.flow import Flow, RequestTrace
from cachegw.gateway.request.hits import hit_response, hit_stream
from cachegw.gateway.request.rate_limits import RateLimiter
from cachegw.gateway.request.tenants import PrefixSalts, Tenants
from cachegw.gateway.request.tracing import Tracing
from cachegw.gateway.request.volatile_learner import VolatileLearner
from cachegw.gateway.storage.entry_ids import EntryIds
from cachegw.gateway.storage.interfaces import ReplyStore
from cachegw.gateway.storage.recorder import Recorder
from cachegw.gateway.storage.request_record import NOT_HITS, CacheResult
from cachegw.gateway.storage.store import reply_key
from cachegw.gateway.storage.tables import CacheEntry
from cachegw.gateway.upstream.proxy import Backends
from cachegw.gateway.upstream.streams import SseRecorder, StreamRelay
from cachegw.policies.cache_keys import request_keys
from cachegw.policies.cacheability import CachePolicy, decide
from cachegw.policies.canonicalize import normalize_reply
from cachegw.protocol.errors import ApiError, error_code
from cachegw.protocol.http import read_limited_body
from cachegw.protocol.requests import ChatCompletionRequest, CompletionRequest, load_json, parse_request

log = logging.getLogger("cachegw.gateway")


def request_ttl(request: Request, settings: Settings) -> int:
    """How long an answer to this request is kept: ``x-cache-ttl`` within ``max_ttl_seconds``, else
    the configured default (every route that stores answers reads it so)."""
    raw = request.headers.get("x-cache-ttl")
    if raw is None:
        return settings.cache.ttl_seconds
    raw = raw.strip()
    if not (raw.isascii() and raw.isdigit()) or int(raw) <= 0:  # "²".isdigit() is True
        raise ApiError(400, "x-cache-ttl must be a positive number of seconds.", param="x-cache-ttl")
    return min(int(raw), settings.cache.max_ttl_seconds)


def request_max_false_hit_rate(request: Request) -> float | None:
    """The request's own false-hit target (``x-cache-max-false-hit-rate``), which can only tighten the
    scope's configured one (None: the configured one applies)."""
    raw = request.headers.get("x-cache-max-false-hit-rate")
    if raw is None:
        return None
    try:
        rate = float(raw.strip())
    except ValueError:
        rate = -1.0
    if not 0 < rate < 1:  # NaN fails too
        raise ApiError(
            400,
            "x-cache-max-false-hit-rate must be a rate between 0 and 1 (exclusive), e.g. 0.01.",
            param="x-cache-max-false-hit-rate",
        )
    return rate


class Gateway:
    """The parts a request needs, and the pipeline over them (``handle``)."""

    def __init__(
        self,
        live: LiveSettings,
        tenants: Tenants,
        volatile: VolatileLearner,
        cache: ResponseCache,
        backends: Backends,
        store: ReplyStore,
        metrics: GatewayMetrics,
        recorder: Recorder,
        salts: PrefixSalts,
        entry_ids: EntryIds,
        limits: RateLimiter,
        auditor: Auditor | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        """The parts ``handle`` uses, built by ``gateway/compose.py``; ``auditor`` re-asks a share of
        semantic hits and near misses (the false-hit bound's evidence), None audits nothing; ``tracing``
        records each request's spans (None: no tracing)."""
        self.live, self.tenants, self.volatile = live, tenants, volatile
        self.cache, self.backends, self.store = cache, backends, store
        self.metrics, self.recorder, self.salts = metrics, recorder, salts
        self.entry_ids, self.auditor, self.limits = entry_ids, auditor, limits
        self.tracing = tracing or Tracing()
        self._tasks: set[asyncio.Task] = set()  # stream bookkeeping that outlives its response

    @property
    def settings(self) -> Settings:
        """The settings in force: config.toml with the run-time changes over it."""
        return self.live.current

    async def handle(
        self, request: Request, endpoint: str, api: str | None = None, raw: bytes | None = None
    ) -> Response:
        """Answer one chat or completions request. The other APIs (``api``: responses, messages) come
        translated into a chat body (``raw``), so every API shares one cache; their routes translate the
        answer back (gateway/api/)."""
        trace = RequestTrace.begin(self.tracing.tracer, request.headers, api or endpoint, endpoint)
        try:
            return await self._handle(request, endpoint, api, raw, trace)
        except BaseException as exc:  # recorded requests ended their span already
            trace.fail(exc.status if isinstance(exc, ApiError) else 500, f"{type(exc).__name__}: {exc}")
            raise

    async def _handle(
        self, request: Request, endpoint: str, api: str | None, raw: bytes | None, trace: RequestTrace
    ) -> Response:
        settings = self.settings  # one consistent view for the whole request
        tenant = self.tenants.from_headers(request.headers)
        if raw is None:
            raw = await read_limited_body(request, settings.gateway.max_request_bytes)
        parse_request(ChatCompletionRequest if endpoint == "chat" else CompletionRequest, raw)
        body = load_json(raw)  # NaN, Infinity or 1e400 get a 400 here: they cannot be forwarded
        if body.get("model") == "":
            raise ApiError(
                400, "model must be a non-empty string; leave it out for the default.", param="model"
            )
        model = body.get("model") or ""
        self.tenants.check_priority(tenant, body.get("priority"))
        if self.limits.configured:  # a 429 before any work when the tenant is over its budget
            await self.limits.admit(tenant)
        candidates = await self.backends.route(model or None)  # 404 for an unknown model, before any work
        ttl = request_ttl(request, settings)
        max_rate = request_max_false_hit_rate(request)
        policy = CachePolicy(
            serve_temperature_above_zero=settings.cache.serve_temperature_above_zero,
            serve_unset_temperature=settings.cache.serves_unset_temperature(model, tenant.name),
        )
        cacheable = decide(body, request.headers, policy)
        flow = Flow.begin(endpoint, tenant, model, body, cacheable, trace)
        flow.record.api = api or endpoint
        restore = self.store.reply_restorer(tenant.cache_key)
        learn = not cacheable.keeps_nothing  # no-store: not even its system prompt is kept
        flow.canonicalized(
            await self.volatile.canonicalize(tenant.id, body, settings.canonicalize, restore, learn)
        )
        body = flow.body
        flow.keys = request_keys(tenant.cache_key, model, endpoint, body)
        record = flow.record
        use_cache = settings.cache.enabled
        if not use_cache:
            record.reason = "disabled"
        if use_cache and cacheable.may_serve:
            flow.lookup = await trace.lookup(
                self.cache.lookup(
                    tenant.cache_key, tenant.name, model, flow.keys, fresh=cacheable.fresh, max_rate=max_rate
                )
            )
            self.metrics.lookup.observe(flow.lookup.lookup_ms / 1e3)
            if flow.lookup.embed_ms is not None:
                self.metrics.embedding.observe(flow.lookup.embed_ms / 1e3)
            record.reason = flow.lookup.reason
            if flow.lookup.entry is not None:
                return await self._serve_hit(flow)
            record.cache_result = CacheResult.MISS
        store = use_cache and cacheable.may_store
        path = "/chat/completions" if endpoint == "chat" else "/completions"
        if settings.tenants.prefix_isolation:  # after the keys: the gateway's own cache is unchanged
            flow.cache_salt = self._prefix_salt(flow)
        try:  # the canonical prefix picks the backend (with routing = "kv", what each holds); none up: 503
            urls = self.backends.order(candidates, endpoint, body)
            salt = flow.cache_salt if flow.cache_salt is not None else body.get("cache_salt")
            urls, kv = await self.backends.kv_order(urls, endpoint, body, salt)
        except ApiError as exc:
            await self._record_failure(flow, exc, time.perf_counter())
            raise
        if kv is not None:
            record.route, record.expected_cached_tokens = kv.reason, kv.expected_cached_tokens
        if record.stream:
            return await self._forward_stream(flow, urls, path, body, store, ttl)
        return await self._forward_json(flow, urls, path, body, store, ttl)

    async def _serve_hit(self, flow: Flow) -> Response:
        assert flow.lookup is not None and flow.lookup.entry is not None
        entry = flow.lookup.entry
        flow.record.cache_result = flow.lookup.result
        self.cache.record_hit(entry)
        stored = json.loads(entry.response)
        usage = stored.get("usage") or {}
        await self._record(flow, 200, usage)
        if flow.lookup.result == CacheResult.SEMANTIC_HIT:
            self._offer_audit(flow, "hit", entry, None)
        if not flow.record.stream:
            return JSONResponse(hit_response(stored, flow.record.id), headers=flow.headers(self.entry_ids))
        include_usage = bool((flow.body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            hit_stream(stored, flow.record.id, flow.record.endpoint, include_usage),
            media_type="text/event-stream",
            headers=flow.headers(self.entry_ids),
        )

    async def _forward_json(
        self, flow: Flow, urls: list[str], path: str, body: dict, store: bool, ttl: int
    ) -> Response:
        start = time.perf_counter()
        record = flow.record
        try:
            status, data, record.backend_ms, record.backend = await self.backends.post_json(
                urls, path, body, flow.cache_salt, flow.draft(), flow.upstream_headers()
            )
        except ApiError as exc:  # down, timed out, garbled: the log must show it too
            await self._record_failure(flow, exc, start)
            raise
        flow.trace.backend_done(record.backend, status)
        record.response_id = data.get("id") if isinstance(data.get("id"), str) else None
        self.metrics.backend.observe(record.backend_ms / 1e3)
        if status == 200:
            await self._after_answer(flow, data, store, ttl)
        else:
            self._count_backend_error(status, data)
        await self._record(
            flow, status, data.get("usage") or {}, None if status == 200 else json.dumps(data)[:500]
        )
        return JSONResponse(data, status_code=status, headers=flow.headers(self.entry_ids))

    async def _forward_stream(
        self, flow: Flow, urls: list[str], path: str, body: dict, store: bool, ttl: int
    ) -> Response:
        client_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        upstream = {**body, "stream_options": {**(body.get("stream_options") or {}), "include_usage": True}}
        start = time.perf_counter()
        record = flow.record
        try:
            record.backend, response = await self.backends.open_stream(
                urls, path, upstream, flow.cache_salt, flow.draft(), flow.upstream_headers()
            )
        except ApiError as exc:
            await self._record_failure(flow, exc, start)
            raise
        if response.status_code != 200:
            data = json.loads(await response.aread() or b"{}")
            await response.aclose()
            self._count_backend_error(response.status_code, data)
            await self._record(flow, response.status_code, {}, json.dumps(data)[:500])
            return JSONResponse(data, status_code=response.status_code, headers=flow.headers(self.entry_ids))

        async def finish(recorder: SseRecorder) -> None:
            record.backend_ms = (time.perf_counter() - start) * 1e3
            await self._finish_stream(flow, recorder, store, ttl)

        gone = self.backends.gone(record.backend or "")
        stream = StreamRelay(
            response, SseRecorder(record.endpoint), finish, self._tasks, not client_usage, gone
        )
        headers = flow.headers(self.entry_ids)
        return StreamingResponse(stream.events(), media_type="text/event-stream", headers=headers)

    async def _finish_stream(self, flow: Flow, recorder: SseRecorder, store: bool, ttl: int) -> None:
        flow.record.response_id = recorder.meta.get("id")
        flow.trace.backend_done(flow.record.backend, 200, recorder.broken)
        if recorder.broken is not None:  # logged as the 502 the client was told of, never stored
            self.metrics.count_error(502, "backend_error")
            broke = f"backend_error: stream broke after {recorder.relayed_bytes} bytes: {recorder.broken}"
            await self._record(flow, 502, recorder.usage or {}, broke[:500])
            return
        complete = recorder.complete_response()
        if complete is not None:
            await self._after_answer(flow, complete, store, ttl)
        error = None if complete is not None else "stream incomplete or failed: not stored"
        await self._record(flow, 200, recorder.usage or {}, error)

    def _prefix_salt(self, flow: Flow) -> str:
        """The salt the backend's prefix cache gets for this tenant (and the client's own salt)."""
        return self.salts.salt(self.tenants.prefix_key(flow.tenant), flow.body.get("cache_salt"))

    def _offer_audit(
        self, flow: Flow, kind: Literal["hit", "near-miss"], entry: CacheEntry, fresh: dict | None
    ) -> None:
        """Hand a semantic hit (or a near miss and its fresh answer) to the auditor: never waits."""
        lk = flow.lookup
        if self.auditor is None or lk is None or lk.score is None:
            return
        links = self.settings.cache.near_miss_links and (kind == "near-miss" or lk.reason == "link")
        if lk.scope_line is None and not links:
            return  # audits feed the error bound and the links: other scopes are not audited
        salt = flow.cache_salt
        if salt is None and self.settings.tenants.prefix_isolation:  # a hit computed none
            salt = self._prefix_salt(flow)
        r = flow.record
        job = AuditJob(
            kind,
            r.model,
            flow.tenant.name,
            lk.score,
            entry,
            r.id,
            r.endpoint,
            flow.body,
            salt,
            fresh,
            r.stored_entry_id,
        )
        self.auditor.offer(job)

    async def _after_answer(self, flow: Flow, data: dict, store: bool, ttl: int) -> None:
        """Remember the reply's exact bytes, and store the answer when policy and quality allow; then
        offer a near miss's audit (after the store: a right one links the entry just stored)."""
        record = flow.record
        choice = (data.get("choices") or [{}])[0]
        chat = record.endpoint == "chat"
        text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
        replies: dict[str, str] = {}
        if isinstance(text, str) and text and not flow.cacheable.keeps_nothing:
            replies[reply_key(flow.tenant.cache_key, normalize_reply(text))] = text
        try:
            if store and flow.keys is not None:
                embedding = flow.lookup.embedding if flow.lookup else None
                record.stored_entry_id = await flow.trace.store(
                    self.cache.insert(
                        flow.tenant.cache_key,
                        record.model,
                        record.endpoint,
                        flow.keys,
                        embedding,
                        data,
                        ttl,
                        replies,
                    )
                )
            if replies and record.stored_entry_id is None:  # not stored: the reply text alone (one commit)
                await asyncio.to_thread(self.store.remember_replies, replies)
        except Exception:  # a storage problem must not fail an answer the client already has
            log.exception("could not store the answer of %s", record.id)
        if flow.lookup is not None and flow.lookup.near is not None:
            self._offer_audit(flow, "near-miss", flow.lookup.near, data)

    def _count_backend_error(self, status: int, data: dict) -> None:
        """A backend's own error, passed through as it came (a sampling value it refuses, ...)."""
        self.metrics.count_error(status, error_code(data) or "backend_error")

    async def _record_failure(self, flow: Flow, exc: ApiError, backend_start: float) -> None:
        flow.record.backend_ms = (time.perf_counter() - backend_start) * 1e3
        await self._record(flow, exc.status, {}, f"{exc.code}: {exc.message}"[:500])

    async def _record(self, flow: Flow, status: int, usage: dict, error: str | None = None) -> None:
        record = flow.close(status, usage, error, log_query=self.settings.gateway.log_query_text)
        if self.limits.configured and record.cache_result in NOT_HITS:
            await self.limits.spend(
                flow.tenant, (record.prompt_tokens or 0) + (record.completion_tokens or 0)
            )
        flow.trace.close(record)
        self.metrics.observe_request(record)
        await self.recorder.record(record)
