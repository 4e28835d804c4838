"""``POST /v1/embeddings`` through the gateway: an exact cache entry per input, the rest from a backend.

Embeddings are deterministic, so each input has its own exact key: the tenant's cache key, the model,
the endpoint "embeddings", the encoding options (``encoding_format``, ``dimensions``) and the input
itself, text or token ids (``policies/cache_keys.py``). A request whose inputs were all seen is
answered from the cache alone; otherwise only the inputs not found (each once, however often the
request repeats it) go to one backend, and the answers are merged back in the request's order.

``usage`` counts what the backend computed for this request: the tokens of the inputs it embedded,
0 when every input came from the cache. ``x-cache`` is ``exact-hit`` only when every input came from
the cache (``miss`` otherwise, ``bypass`` when the cache was not asked), and ``x-cache-hits: 3/5``
says how many inputs did. ``Cache-Control: no-cache`` stores without serving, ``no-store`` neither,
as for chat (``policies/cacheability.py``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from cachegw.gateway.cache.response_cache import ResponseCache
from cachegw.gateway.live_settings import LiveSettings
from cachegw.gateway.metrics import GatewayMetrics
from cachegw.gateway.request.flow import Flow
from cachegw.gateway.request.pipeline import request_ttl
from cachegw.gateway.request.tenants import Tenants
from cachegw.gateway.storage.entry_ids import EntryIds
from cachegw.gateway.storage.recorder import Recorder
from cachegw.gateway.storage.request_record import CacheResult
from cachegw.gateway.upstream.proxy import Backends
from cachegw.policies.cache_keys import RequestKeys, request_keys
from cachegw.policies.cacheability import CachePolicy, decide
from cachegw.protocol.embedding_request import EmbeddingInput, parse_embedding_request
from cachegw.protocol.errors import ApiError, error_code
from cachegw.protocol.http import read_limited_body
from cachegw.protocol.requests import load_json

log = logging.getLogger("cachegw.gateway")
ENDPOINT = "embeddings"


@dataclass
class _Input:
    """One distinct input of the request, where it appears, and its embedding once known."""

    value: EmbeddingInput
    keys: RequestKeys
    at: list[int]  # its indices in the request
    embedding: Any = None  # the stored or returned value: a list of floats, or base64 text
    cached: bool = False
    model: str | None = None  # the name the backend answered under, kept with the entry


def _distinct(inputs: list[EmbeddingInput], key_of: Any) -> list[_Input]:
    """The inputs once each, in order of first appearance (a repeat within the request is one input)."""
    seen: dict[str, _Input] = {}
    for i, value in enumerate(inputs):
        keys = key_of(value)
        if keys.exact in seen:
            seen[keys.exact].at.append(i)
        else:
            seen[keys.exact] = _Input(value, keys, [i])
    return list(seen.values())


def _bad_backend(url: str, why: str) -> ApiError:
    return ApiError(
        502, f"The backend at {url} sent an embeddings answer that {why}.",
        type="backend_error", code="backend_bad_response",
    )  # fmt: skip


def _embeddings_of(data: dict[str, Any], count: int, url: str) -> list[Any]:
    """The ``count`` embeddings of a backend's answer, by their ``index``."""
    items = data.get("data") if isinstance(data, dict) else None
    if not isinstance(items, list) or len(items) != count:
        raise _bad_backend(url, f"does not hold {count} embeddings")
    out: list[Any] = [None] * count
    for position, item in enumerate(items):
        index = item.get("index", position) if isinstance(item, dict) else None
        if not isinstance(index, int) or not 0 <= index < count or "embedding" not in item:
            raise _bad_backend(url, "has an item without an index or an embedding")
        out[index] = item["embedding"]
    if any(e is None for e in out):
        raise _bad_backend(url, "repeats an index")
    return out


class Embeddings:
    """The embeddings route's flow over the parts it shares with the chat pipeline."""

    def __init__(
        self,
        live: LiveSettings,
        tenants: Tenants,
        cache: ResponseCache,
        backends: Backends,
        metrics: GatewayMetrics,
        recorder: Recorder,
        entry_ids: EntryIds,
    ) -> None:
        self.live, self.tenants, self.cache, self.backends = live, tenants, cache, backends
        self.metrics, self.recorder, self.entry_ids = metrics, recorder, entry_ids

    async def handle(self, request: Request) -> Response:
        settings = self.live.current
        tenant = self.tenants.from_headers(request.headers)
        raw = await read_limited_body(request, settings.gateway.max_request_bytes)
        req = parse_embedding_request(raw)
        body = load_json(raw)
        if req.model == "":
            raise ApiError(
                400, "model must be a non-empty string; leave it out for the default.", param="model"
            )
        inputs = req.inputs()
        model = req.model or ""
        candidates = await self.backends.route(model or None)  # 404 for an unknown model, before any work
        ttl = request_ttl(request, settings)
        # nothing samples (no body field of the table applies): the request's Cache-Control decides
        cacheable = decide({}, request.headers, CachePolicy(serve_temperature_above_zero=True))
        flow = Flow.begin(ENDPOINT, tenant, model, {}, cacheable)
        flow.record.api = ENDPOINT
        options = {"encoding_format": req.encoding_format or "float", "dimensions": req.dimensions}
        distinct = _distinct(
            inputs, lambda value: request_keys(tenant.cache_key, model, ENDPOINT, {"input": value, **options})
        )
        use_cache = settings.cache.enabled
        if not use_cache:
            flow.record.reason = "disabled"
        elif cacheable.may_serve:
            await self._look_up(flow, distinct)
        found = sum(len(d.at) for d in distinct if d.cached)
        served_model = model
        usage = {"prompt_tokens": 0, "total_tokens": 0}
        missing = [d for d in distinct if not d.cached]
        if missing:
            status, data = await self._ask_backend(flow, candidates, body, missing)
            if status != 200:
                self.metrics.count_error(status, error_code(data) or "backend_error")
                await self._record(flow, status, {}, json.dumps(data)[:500])
                return JSONResponse(data, status_code=status, headers=self._headers(flow, found, len(inputs)))
            named = data.get("model")
            served_model = named if isinstance(named, str) else model
            told = data.get("usage")
            if isinstance(told, dict):
                usage = {k: v for k, v in told.items() if k in ("prompt_tokens", "total_tokens")}
            if use_cache and cacheable.may_store:
                await self._store(flow, missing, served_model, ttl)
        else:  # every input from the cache: the name the backend gave when it computed the first
            served_model = distinct[0].model or model
        answer: list[dict[str, Any]] = [{} for _ in inputs]
        for d in distinct:
            for i in d.at:
                answer[i] = {"object": "embedding", "index": i, "embedding": d.embedding}
        await self._record(flow, 200, usage)
        response = {"object": "list", "data": answer, "model": served_model, "usage": usage}
        return JSONResponse(response, headers=self._headers(flow, found, len(inputs)))

    async def _look_up(self, flow: Flow, distinct: list[_Input]) -> None:
        """Each distinct input's exact entry, if one may serve it; the record says how many did."""
        start = time.perf_counter()
        tenant = flow.tenant
        for d in distinct:
            lookup = await self.cache.lookup(
                tenant.cache_key, tenant.name, flow.record.model, d.keys, semantic=False,
                fresh=flow.cacheable.fresh,
            )  # fmt: skip
            if lookup.entry is None:
                continue
            try:
                stored = json.loads(lookup.entry.response)
                d.embedding, d.model, d.cached = stored["embedding"], stored.get("model"), True
            except (ValueError, KeyError, TypeError, AttributeError):  # not an embeddings entry
                continue
            self.cache.record_hit(lookup.entry)
        record = flow.record
        record.lookup_ms = (time.perf_counter() - start) * 1e3
        self.metrics.lookup.observe(record.lookup_ms / 1e3)
        hits = sum(d.cached for d in distinct)
        all_hit = hits == len(distinct)
        record.cache_result = CacheResult.EXACT_HIT if all_hit else CacheResult.MISS
        record.reason = "exact" if all_hit else "partial-exact" if hits else "exact-only"

    async def _ask_backend(
        self, flow: Flow, candidates: list[str], body: dict, missing: list[_Input]
    ) -> tuple[int, dict[str, Any]]:
        """The backend's answer for the inputs not found; each ``missing`` input gets its embedding."""
        upstream = {**body, "input": [d.value for d in missing]}
        record, start = flow.record, time.perf_counter()
        try:
            # routed by the first input, as a completion by its prompt: inputs spread over the backends
            urls = self.backends.order(candidates, ENDPOINT, {"prompt": missing[0].value})
            status, data, record.backend_ms, record.backend = await self.backends.post_json(
                urls, "/embeddings", upstream, headers=flow.upstream_headers()
            )
        except ApiError as exc:
            record.backend_ms = (time.perf_counter() - start) * 1e3
            await self._record(flow, exc.status, {}, f"{exc.code}: {exc.message}"[:500])
            raise
        self.metrics.backend.observe(record.backend_ms / 1e3)
        if status == 200:
            try:
                for d, embedding in zip(
                    missing, _embeddings_of(data, len(missing), record.backend or ""), strict=True
                ):
                    d.embedding = embedding
            except ApiError as exc:
                await self._record(flow, exc.status, {}, f"{exc.code}: {exc.message}"[:500])
                raise
        return status, data

    async def _store(self, flow: Flow, missing: list[_Input], model: str, ttl: int) -> None:
        """One exact entry per input the backend embedded; a storage problem never fails the answer."""
        try:
            for d in missing:
                await self.cache.insert_exact(
                    flow.tenant.cache_key, flow.record.model, ENDPOINT, d.keys,
                    {"embedding": d.embedding, "model": model}, ttl,
                    d.value if isinstance(d.value, str) else "",
                )  # fmt: skip
        except Exception:
            log.exception("could not store the embeddings of %s", flow.record.id)

    def _headers(self, flow: Flow, found: int, total: int) -> dict[str, str]:
        return {**flow.headers(self.entry_ids), "x-cache-hits": f"{found}/{total}"}

    async def _record(self, flow: Flow, status: int, usage: dict, error: str | None = None) -> None:
        record = flow.close(status, usage, error, log_query=False)
        self.metrics.observe_request(record)
        await self.recorder.record(record)
