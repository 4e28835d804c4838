"""The gateway's HTTP app. One direction: request -> policy -> cache -> canonicalize -> backend -> record.

The cache keys are computed on the canonical form of the request, so requests that differ only
in whitespace, key order or Unicode form are exact repeats; the same canonical body is what the
backend receives, so its prefix cache sees byte-identical prefixes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.admin_api import admin_router, dashboard_page, json_body
from gateway.admin_auth import AdminAuth
from gateway.admin_store import AdminStore
from gateway.audits import AuditJob, Auditor
from gateway.cache import ResponseCache
from gateway.cache_keys import RequestKeys, request_keys
from gateway.cache_result import Lookup
from gateway.config import Settings
from gateway.entry_ids import EntryIds
from gateway.feedback import parse_feedback, report_bad
from gateway.hits import hit_response, hit_stream
from gateway.live_settings import LiveSettings
from gateway.metrics import BackendCounts, GatewayMetrics
from gateway.metrics_http import metrics_response
from gateway.prefix_salt import PrefixSalts
from gateway.proxy import Backends
from gateway.recorder import Recorder
from gateway.store import Store, reply_key
from gateway.streams import SseRecorder, relay
from gateway.tenants import Tenant, Tenants
from gateway.volatile_learner import VolatileLearner
from policies.cacheability import Cacheability, CachePolicy, decide
from policies.canonical_text import normalize_for_match, normalize_reply
from policies.canonicalize import Restore
from policies.volatile import Moved
from protocol.errors import ApiError, error_code
from protocol.http import install_error_handlers, read_limited_body
from protocol.requests import ChatCompletionRequest, CompletionRequest, load_json, parse_request

log = logging.getLogger("cachegw.gateway")
QUERY_CHARS = 500  # of the last user message kept in the request log (gateway.log_query_text)


def query_hash(query: str) -> str:
    """Groups repeats of one query in reports, whatever their whitespace or Unicode form."""
    return hashlib.sha256(normalize_for_match(query).encode()).hexdigest()[:16]


class Flow:
    """State of one request as it moves through the gateway."""

    def __init__(
        self, endpoint: str, tenant: Tenant, model: str, body: dict[str, Any], cacheable: Cacheability
    ) -> None:
        self.id = f"req-{uuid.uuid4().hex}"
        self.start = time.perf_counter()
        self.endpoint, self.tenant, self.model, self.body = endpoint, tenant, model, body
        self.stream = bool(body.get("stream"))
        self.cacheable = cacheable
        self.rules: list[str] = []
        self.moved: tuple[Moved, ...] = ()  # volatile values canonicalization moved out of the prompt
        self.keys: RequestKeys | None = None
        self.lookup: Lookup | None = None
        self.result = "bypass"
        self.reason = cacheable.reason  # x-cache-reason: the cacheability row, or the lookup's why
        self.backend_ms: float | None = None
        self.backend: str | None = None  # the backend that answered a miss
        self.response_id: str | None = None  # the body's id (the backend's on a miss)
        self.stored_entry: int | None = None  # a miss stored into the cache
        self.cache_salt: str | None = None  # sent upstream in place of the client's (prefix isolation)
        self.canonical: dict[str, Any] = body  # the canonical body the backend is (or would be) sent

    def headers(self, entry_ids: EntryIds) -> dict[str, str]:
        h = {"x-cache": self.result, "x-cache-reason": self.reason, "x-request-id": self.id}
        lk = self.lookup
        if lk is not None and lk.similarity is not None:
            h["x-cache-similarity"] = f"{lk.similarity:.4f}"
        if lk is not None and lk.entry is not None:
            h["x-cache-entry"] = entry_ids.encode(self.tenant.id, lk.entry.id)  # opaque, per tenant
        return h


class Gateway:
    def __init__(
        self, live: LiveSettings, store: Store, cache: ResponseCache, backends: Backends, admin_token: str
    ) -> None:
        self.live = live
        self.store, self.cache, self.backends = store, cache, backends
        self.admin = AdminStore(store.session)
        self.auth = AdminAuth(admin_token)
        self.salts = PrefixSalts(admin_token)
        self.entry_ids = EntryIds(admin_token)
        self.volatile = VolatileLearner()
        self.tenants = Tenants(self.settings.tenants)
        self.policy: CachePolicy
        self.apply_settings()
        self.metrics = GatewayMetrics(
            lambda: float(cache.entries),
            BackendCounts(backends.answered, backends.refused, backends.urls, backends.down),
            index_entries=lambda: float(len(cache.index)),
            sync_age=(lambda: time.time() - cache.synced_at) if self.settings.cache.sync_interval_s else None,
        )
        self.recorder = Recorder(store, per_request=self.settings.gateway.request_log_commit == "per_request")
        self._tasks: set[asyncio.Task] = set()  # stream bookkeeping that outlives its response
        self.auditor: Auditor | None = None  # false-hit audits (serve.py starts its worker)

    @property
    def settings(self) -> Settings:
        """The settings in force: config.toml with the run-time changes over it."""
        return self.live.current

    def apply_settings(self) -> None:
        """Pass changed settings on to the parts that keep their own copy (the cache reads its own
        through a provider); requests already under way keep the view they read."""
        self.policy = CachePolicy(
            serve_temperature_above_zero=self.settings.cache.serve_temperature_above_zero
        )

    async def refresh_settings(self) -> None:
        """Pick up a change another replica made (a cheap version read)."""
        if await asyncio.to_thread(self.live.changed_elsewhere):
            await asyncio.to_thread(self.live.load)
            self.apply_settings()

    def _restorer(self, tenant: Tenant) -> Restore:
        return lambda normalized: self.store.lookup_reply(reply_key(tenant.cache_key, normalized))

    @staticmethod
    def _ttl(request: Request, settings: Settings) -> int:
        raw = request.headers.get("x-cache-ttl")
        if raw is None:
            return settings.cache.ttl_seconds
        raw = raw.strip()
        if not (raw.isascii() and raw.isdigit()) or int(raw) <= 0:  # "²".isdigit() is True
            raise ApiError(400, "x-cache-ttl must be a positive number of seconds.", param="x-cache-ttl")
        return min(int(raw), settings.cache.max_ttl_seconds)

    async def handle(self, request: Request, endpoint: str) -> Response:
        settings = self.settings  # one consistent view for the whole request
        tenant = self.tenants.from_headers(request.headers)
        raw = await read_limited_body(request, settings.gateway.max_request_bytes)
        parse_request(ChatCompletionRequest if endpoint == "chat" else CompletionRequest, raw)
        body = load_json(raw)  # NaN, Infinity or 1e400 get a 400 here: they cannot be forwarded
        if body.get("model") == "":
            raise ApiError(
                400, "model must be a non-empty string; leave it out for the default.", param="model"
            )
        model = body.get("model") or ""
        candidates = await self.backends.route(model or None)  # 404 for an unknown model, before any work
        ttl = self._ttl(request, settings)
        policy = self.policy
        if settings.cache.serves_unset_temperature(model, tenant.name):
            policy = replace(policy, serve_unset_temperature=True)
        cacheable = decide(body, request.headers, policy)
        flow = Flow(endpoint, tenant, model, body, cacheable)
        restore = self._restorer(tenant)
        learn = not cacheable.keeps_nothing  # no-store: not even its system prompt is kept
        canon = await self.volatile.canonicalize(tenant.id, body, settings.canonicalize, restore, learn)
        body, flow.rules, flow.moved = canon.body, canon.rules, canon.moved
        flow.canonical = body
        flow.keys = request_keys(tenant.cache_key, model, endpoint, body)
        use_cache = settings.cache.enabled
        if not use_cache:
            flow.reason = "disabled"
        if use_cache and cacheable.may_serve:
            flow.lookup = await self.cache.lookup(
                tenant.cache_key, tenant.name, model, flow.keys, fresh=cacheable.fresh
            )
            self.metrics.lookup.observe(flow.lookup.lookup_ms / 1e3)
            if flow.lookup.embed_ms is not None:
                self.metrics.embedding.observe(flow.lookup.embed_ms / 1e3)
            flow.reason = flow.lookup.reason
            if flow.lookup.entry is not None:
                return await self._serve_hit(flow)
            flow.result = "miss"
        store = use_cache and cacheable.may_store
        path = "/chat/completions" if endpoint == "chat" else "/completions"
        try:  # the canonical prefix picks the backend; none up: a 503 at once
            urls = self.backends.order(candidates, endpoint, body)
        except ApiError as exc:
            await self._record_failure(flow, exc, time.perf_counter())
            raise
        if settings.tenants.prefix_isolation:  # after the keys: the gateway's own cache is unchanged
            flow.cache_salt = self.salts.salt(self.tenants.prefix_key(tenant), body.get("cache_salt"))
        if flow.stream:
            return await self._forward_stream(flow, urls, path, body, store, ttl)
        return await self._forward_json(flow, urls, path, body, store, ttl)

    async def _serve_hit(self, flow: Flow) -> Response:
        assert flow.lookup is not None and flow.lookup.entry is not None
        entry = flow.lookup.entry
        flow.result = flow.lookup.result
        self.cache.record_hit(entry)
        stored = json.loads(entry.response)
        usage = stored.get("usage") or {}
        await self._record(flow, 200, usage)
        if flow.result == "semantic-hit":
            self._offer_audit(flow, "hit", entry, None)
        if not flow.stream:
            return JSONResponse(hit_response(stored, flow.id), headers=flow.headers(self.entry_ids))
        include_usage = bool((flow.body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            hit_stream(stored, flow.id, flow.endpoint, include_usage),
            media_type="text/event-stream",
            headers=flow.headers(self.entry_ids),
        )

    async def _forward_json(
        self, flow: Flow, urls: list[str], path: str, body: dict, store: bool, ttl: int
    ) -> Response:
        start = time.perf_counter()
        try:
            status, data, flow.backend_ms, flow.backend = await self.backends.post_json(
                urls, path, body, flow.cache_salt
            )
        except ApiError as exc:  # down, timed out, garbled: the log must show it too
            await self._record_failure(flow, exc, start)
            raise
        flow.response_id = data.get("id") if isinstance(data.get("id"), str) else None
        self.metrics.backend.observe(flow.backend_ms / 1e3)
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
        try:
            flow.backend, response = await self.backends.open_stream(urls, path, upstream, flow.cache_salt)
        except ApiError as exc:
            await self._record_failure(flow, exc, start)
            raise
        if response.status_code != 200:
            data = json.loads(await response.aread() or b"{}")
            await response.aclose()
            self._count_backend_error(response.status_code, data)
            await self._record(flow, response.status_code, {}, json.dumps(data)[:500])
            return JSONResponse(data, status_code=response.status_code, headers=flow.headers(self.entry_ids))
        recorder = SseRecorder(flow.endpoint)

        async def events():
            finished = False
            try:
                gone = self.backends.gone(flow.backend or "")
                async for event in relay(response, recorder, not client_usage, gone):
                    if recorder.done and not finished:
                        # Store before [DONE] reaches the client: a repeat sent right after the
                        # stream ends must find the answer (read-your-writes).
                        finished = True
                        flow.backend_ms = (time.perf_counter() - start) * 1e3
                        await self._finish_stream(flow, recorder, store, ttl)
                    yield event
                if not finished:  # the backend broke the stream: relay ended it with an error event
                    finished = True
                    flow.backend_ms = (time.perf_counter() - start) * 1e3
                    await self._finish_stream(flow, recorder, store, ttl)
            finally:  # the client went away: record it, store nothing
                if not finished:
                    flow.backend_ms = (time.perf_counter() - start) * 1e3
                    task = asyncio.get_running_loop().create_task(
                        self._finish_stream(flow, recorder, store, ttl)
                    )
                    self._tasks.add(task)  # a task without a reference can be collected mid-run
                    task.add_done_callback(self._tasks.discard)

        headers = flow.headers(self.entry_ids)
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def _finish_stream(self, flow: Flow, recorder: SseRecorder, store: bool, ttl: int) -> None:
        flow.response_id = recorder.meta.get("id")
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

    def _offer_audit(
        self, flow: Flow, kind: Literal["hit", "near-miss"], entry: Any, fresh: dict | None
    ) -> None:
        """Hand a semantic hit (or a near miss and its fresh answer) to the auditor: never waits."""
        lk = flow.lookup
        if self.auditor is None or lk is None or lk.score is None or lk.scope_line is None:
            return  # audits feed the error bound: only scopes with a false-hit target are audited
        salt = flow.cache_salt
        if salt is None and self.settings.tenants.prefix_isolation:  # a hit computed none
            salt = self.salts.salt(self.tenants.prefix_key(flow.tenant), flow.canonical.get("cache_salt"))
        self.auditor.offer(
            AuditJob(
                kind,
                flow.model,
                flow.tenant.name,
                lk.score,
                entry,
                flow.id,
                flow.endpoint,
                flow.canonical,
                salt,
                fresh,
            )
        )

    async def _after_answer(self, flow: Flow, data: dict, store: bool, ttl: int) -> None:
        """Remember the reply's exact bytes, and store the answer when policy and quality allow."""
        if flow.lookup is not None and flow.lookup.near is not None:
            self._offer_audit(flow, "near-miss", flow.lookup.near, data)
        choice = (data.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") if flow.endpoint == "chat" else choice.get("text")
        replies: dict[str, str] = {}
        if isinstance(text, str) and text and not flow.cacheable.keeps_nothing:
            replies[reply_key(flow.tenant.cache_key, normalize_reply(text))] = text
        try:
            if store and flow.keys is not None:
                embedding = flow.lookup.embedding if flow.lookup else None
                flow.stored_entry = await self.cache.insert(
                    flow.tenant.cache_key, flow.model, flow.endpoint, flow.keys, embedding, data, ttl, replies
                )
            if replies and flow.stored_entry is None:  # not stored: the reply text alone (one commit)
                await asyncio.to_thread(self.store.remember_replies, replies)
        except Exception:  # a storage problem must not fail an answer the client already has
            log.exception("could not store the answer of %s", flow.id)

    def _count_backend_error(self, status: int, data: dict) -> None:
        """A backend's own error, passed through as it came (a sampling value it refuses, ...)."""
        self.metrics.count_error(status, error_code(data) or "backend_error")

    async def _record_failure(self, flow: Flow, exc: ApiError, backend_start: float) -> None:
        flow.backend_ms = (time.perf_counter() - backend_start) * 1e3
        await self._record(flow, exc.status, {}, f"{exc.code}: {exc.message}"[:500])

    async def _record(self, flow: Flow, status: int, usage: dict, error: str | None = None) -> None:
        total_ms = (time.perf_counter() - flow.start) * 1e3
        details = usage.get("prompt_tokens_details") or {}
        lk = flow.lookup
        keys = flow.keys
        query = keys.query if keys else None
        self.metrics.requests.labels(flow.result).inc()
        if lk is not None and lk.similarity is not None and flow.result != "exact-hit":
            self.metrics.similarity.labels(flow.result).observe(lk.similarity)
        self.metrics.total.labels(flow.result).observe(total_ms / 1e3)
        if flow.result in ("miss", "bypass") and usage:
            self.metrics.prompt_tokens.inc(usage.get("prompt_tokens") or 0)
            self.metrics.cached_tokens.inc(details.get("cached_tokens") or 0)
        await self.recorder.record(
            {
                "id": flow.id,
                "ts": time.time(),
                "tenant": flow.tenant.id,
                "model": flow.model,
                "endpoint": flow.endpoint,
                "stream": flow.stream,
                "cache_result": flow.result,
                "similarity": lk.similarity if lk else None,
                "threshold": lk.threshold if lk else None,
                "entry_id": lk.entry.id if lk and lk.entry else None,
                "rules_fired": ",".join(flow.rules),
                "volatile": "; ".join(dict.fromkeys(m.tag for m in flow.moved))[:512] or None,
                "reason": flow.reason,
                "embed_ms": lk.embed_ms if lk else None,
                "lookup_ms": lk.lookup_ms if lk else None,
                "backend_ms": flow.backend_ms,
                "backend": flow.backend,
                "total_ms": total_ms,
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "cached_tokens": details.get("cached_tokens"),
                "status": status,
                "error": error,
                "response_id": flow.response_id if flow.result in ("miss", "bypass") else flow.id,
                "stored_entry_id": flow.stored_entry,
                "scope": keys.scope if keys else None,
                "system_hash": keys.system if keys else None,
                "query_hash": query_hash(query) if query else None,
                "query": query[:QUERY_CHARS] if query and self._log_query(flow) else None,
            }
        )

    def _log_query(self, flow: Flow) -> bool:
        return self.settings.gateway.log_query_text and not flow.cacheable.keeps_nothing


def build_app(gateway_factory) -> FastAPI:
    """``gateway_factory`` is an async context manager yielding a started Gateway (see serve.py)."""
    state: dict[str, Gateway] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async with gateway_factory() as gw:
            state["gw"] = gw
            yield

    # /openapi.json documents the API; FastAPI's /docs pages would load their scripts from a CDN.
    app = FastAPI(title="cachegw gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(
        app, lambda status, code: state["gw"].metrics.count_error(status, code) if state else None
    )
    app.include_router(admin_router(lambda: state["gw"]))

    @app.get("/admin", include_in_schema=False)
    async def dashboard() -> Response:
        return dashboard_page()

    @app.post("/v1/cache/feedback")
    async def feedback(request: Request) -> dict[str, Any]:
        """A tenant flags one of its own answers as bad (by the response id or x-request-id, or the
        x-cache-entry id of a hit)."""
        gw = state["gw"]
        tenant = gw.tenants.from_headers(request.headers)
        request_id, entry_id = parse_feedback(await json_body(request), admin=False)
        return await report_bad(gw, f"tenant:{tenant.name[:16]}", request_id, entry_id, tenant=tenant)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await state["gw"].handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await state["gw"].handle(request, "completions")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        state["gw"].tenants.from_headers(request.headers)
        return {"object": "list", "data": await state["gw"].backends.list_models()}

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Liveness for anyone; counts and backend addresses only with the admin token (they tell
        other tenants' activity). 503 "degraded" while a served model has no reachable backend:
        cached answers are still served on the API routes."""
        gw = state["gw"]
        b = gw.backends
        unreachable = b.unreachable_models()
        status = "degraded" if unreachable else "ok"
        body: dict[str, Any] = {"status": status}
        try:
            gw.auth.check(request.headers.get("authorization"))
        except ApiError:
            return JSONResponse(body, status_code=503 if unreachable else 200)
        body |= {
            "unreachable_models": unreachable,
            "backends": b.urls,
            "backends_refusing": b.refusing(),
            "backends_down": sorted(b.down),  # by the health probes (docs/reliability.md)
            "cache_entries": gw.cache.entries,
            "index_entries": len(gw.cache.index),  # vectors this replica searches (docs/replicas.md)
        }
        return JSONResponse(body, status_code=503 if unreachable else 200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus; 404 here when ``metrics_port`` serves it elsewhere (gateway/metrics_http.py)."""
        return metrics_response(state["gw"], request, own_port=False)

    app.state.gateway = lambda: state.get("gw")  # for the separate metrics listener

    return app
