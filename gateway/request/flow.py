"""One request in flight: what the gateway works with, and the record it fills for the request log.

The record (``RequestRecord``) is created with the flow and filled as the request moves on; ``close``
adds what is known only at the end (status, tokens, times) and hands it to the recorder.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry.context import Context
from opentelemetry.trace import (
    NoOpTracerProvider,
    Span,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from cachegw.configtools.logs import REQUEST_ID
from cachegw.gateway.cache.lookup import Lookup
from cachegw.gateway.request.tenants import Tenant
from cachegw.gateway.storage.entry_ids import EntryIds
from cachegw.gateway.storage.request_record import CacheResult, RequestRecord
from cachegw.policies.cache_keys import RequestKeys
from cachegw.policies.cacheability import Cacheability
from cachegw.policies.canonical_text import normalize_for_match
from cachegw.policies.canonicalize import Canonical

QUERY_CHARS = 500  # of the last user message kept in the request log (gateway.log_query_text)


def query_hash(query: str) -> str:
    """Groups repeats of one query in reports, whatever their whitespace or Unicode form."""
    return hashlib.sha256(normalize_for_match(query).encode()).hexdigest()[:16]


T = TypeVar("T")
REQUEST_ID_HEADER = "x-request-id"
_W3C = TraceContextTextMapPropagator()  # traceparent/tracestate only: no baggage crosses the gateway


def _attrs(**values: Any) -> dict[str, Any]:
    """Span attributes without the unknown ones (OpenTelemetry refuses None)."""
    return {f"cachegw.{k}": v for k, v in values.items() if v is not None}


class RequestTrace:
    """The spans of one request. ``close`` ends it with the request log's record (every answered or
    failed request is recorded once); ``fail`` ends one refused before it had a record."""

    def __init__(self, tracer: Tracer, parent: Context, api: str, endpoint: str) -> None:
        self._tracer = tracer
        self.span = tracer.start_span(
            "cachegw.request", parent, SpanKind.SERVER, _attrs(api=api, endpoint=endpoint)
        )
        self._context = set_span_in_context(self.span, parent)
        self._backend: Span | None = None
        self._ended = False

    @classmethod
    def begin(cls, tracer: Tracer, headers: Mapping[str, str], api: str, endpoint: str) -> RequestTrace:
        """The request's span, a child of the client's ``traceparent`` when it sent one."""
        return cls(tracer, _W3C.extract(headers), api, endpoint)

    @classmethod
    def off(cls) -> RequestTrace:
        """A trace that records nothing (requests built without a tracer)."""
        return cls(NoOpTracerProvider().get_tracer("cachegw"), Context(), "", "")

    async def lookup(self, pending: Awaitable[Lookup]) -> Lookup:
        """Await the cache lookup inside its span, which tells what it found and why."""
        with self._tracer.start_as_current_span("cachegw.lookup", self._context) as span:
            found = await pending
            span.set_attributes(
                _attrs(
                    cache_result=found.result.value,
                    reason=found.reason,
                    similarity=found.similarity,
                    threshold=found.threshold,
                    score=found.score,
                )
            )
            return found

    def backend_headers(self, request_id: str, stream: bool) -> dict[str, str]:
        """Start the backend call's span; the headers that tell the backend the request id and its parent
        span (``traceparent``: the call's span, or the client's own when tracing is off)."""
        if self._backend is None:
            self._backend = self._tracer.start_span(
                "cachegw.backend", self._context, SpanKind.CLIENT, _attrs(stream=stream)
            )
        headers = {REQUEST_ID_HEADER: request_id}
        _W3C.inject(headers, set_span_in_context(self._backend, self._context))
        return headers

    def backend_done(self, url: str | None, status: int, error: str | None = None) -> None:
        """End the backend call's span: who answered, with what (a stream ends when it was relayed)."""
        span, self._backend = self._backend, None
        if span is None:
            return
        span.set_attributes({**_attrs(backend=url), "http.response.status_code": status})
        if status >= 400 or error:
            span.set_status(Status(StatusCode.ERROR, error or f"HTTP {status}"))
        span.end()

    async def store(self, pending: Awaitable[T]) -> T:
        """Await the answer's store inside its span (the entry id it got, when one)."""
        with self._tracer.start_as_current_span("cachegw.store", self._context) as span:
            stored = await pending
            if isinstance(stored, int):
                span.set_attributes(_attrs(entry_id=stored))
            return stored

    def close(self, record: RequestRecord) -> None:
        """End the request's span with what its record says (a backend call still open ends with it)."""
        if self._ended:
            return
        self.backend_done(record.backend, record.status or 0, record.error)
        self.span.set_attributes(
            _attrs(
                model=record.model,
                tenant=record.tenant,
                cache_result=record.cache_result.value,
                reason=record.reason,
                request_id=record.id,
                stream=record.stream,
            )
        )
        self._end(record.status or 0, record.error)

    def fail(self, status: int, message: str) -> None:
        """End a request that failed before it was recorded (a 400 for its body, a 404 for its model)."""
        if not self._ended:
            self._end(status, message)

    def _end(self, status: int, error: str | None) -> None:
        self._ended = True
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:  # a client's mistake is not the server span's error
            self.span.set_status(Status(StatusCode.ERROR, error or f"HTTP {status}"))
        self.span.end()


@dataclass
class Flow:
    record: RequestRecord
    tenant: Tenant
    body: dict[str, Any]  # the canonical body once ``canonicalized``
    cacheable: Cacheability
    start: float = field(default_factory=time.perf_counter)
    keys: RequestKeys | None = None
    lookup: Lookup | None = None
    cache_salt: str | None = None  # sent upstream in place of the client's (prefix isolation)
    trace: RequestTrace = field(default_factory=RequestTrace.off)  # its spans (gateway/request/tracing.py)

    @classmethod
    def begin(
        cls,
        endpoint: str,
        tenant: Tenant,
        model: str,
        body: dict[str, Any],
        cacheable: Cacheability,
        trace: RequestTrace | None = None,
    ) -> Flow:
        record = RequestRecord(
            id=f"req-{uuid.uuid4().hex}",
            ts=0.0,
            tenant=tenant.id,
            model=model,
            endpoint=endpoint,
            stream=bool(body.get("stream")),
            reason=cacheable.reason,  # x-cache-reason: the cacheability row, or the lookup's why
        )
        REQUEST_ID.set(record.id)  # JSON log lines of this request's task name it (configtools/logs.py)
        if trace is None:  # a request without spans (the embeddings API)
            return cls(record, tenant, body, cacheable)
        return cls(record, tenant, body, cacheable, trace=trace)

    def draft(self) -> str | None:
        """A refused near miss's stored answer as the backend's draft (``cachegw_draft``): the text of
        the nearest refused candidate's answer, if the lookup had one.

        A paraphrase the verifier would not serve is often answered with much the same text. The built-in
        engine verifies a draft in one forward pass per few tokens (speculative decoding), so the fresh
        answer comes faster where the model says the same and costs little where it does not; the answer
        itself is the model's either way. Only text answers make drafts: a tool call carries the other
        user's arguments, which the model would rarely repeat.
        """
        entry = self.lookup.refused if self.lookup is not None else None
        if entry is None:
            return None
        try:
            choice = json.loads(entry.response)["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            return None
        if not isinstance(choice, dict):
            return None
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        return text if isinstance(text, str) and text else None

    def upstream_headers(self) -> dict[str, str]:
        """What the backend is told besides the body: the request id and the trace (starts the backend
        call's span)."""
        return self.trace.backend_headers(self.record.id, self.record.stream)

    def canonicalized(self, canon: Canonical) -> None:
        self.body = canon.body
        self.record.rules_fired = ",".join(canon.rules)
        self.record.volatile = "; ".join(dict.fromkeys(m.tag for m in canon.moved))[:512] or None

    def headers(self, entry_ids: EntryIds) -> dict[str, str]:
        r = self.record
        h = {"x-cache": r.cache_result.value, "x-cache-reason": r.reason or "", "x-request-id": r.id}
        lk = self.lookup
        if lk is not None and lk.similarity is not None:
            h["x-cache-similarity"] = f"{lk.similarity:.4f}"
        if lk is not None and lk.entry is not None:
            h["x-cache-entry"] = entry_ids.encode(self.tenant.id, lk.entry.id)  # opaque, per tenant
        if lk is not None and lk.scope_line is not None and r.cache_result == CacheResult.SEMANTIC_HIT:
            h["x-cache-bound"] = f"{lk.scope_line.target:g}"  # the false-hit target it was served under
        return h

    def close(self, status: int, usage: dict, error: str | None, log_query: bool) -> RequestRecord:
        """The record, complete: ``log_query`` keeps the start of the query text."""
        r, lk, keys = self.record, self.lookup, self.keys
        details = usage.get("prompt_tokens_details") or {}
        query = keys.query if keys else None
        r.ts = time.time()
        r.total_ms = (time.perf_counter() - self.start) * 1e3
        if lk is not None:
            r.similarity, r.threshold, r.embed_ms, r.lookup_ms = (
                lk.similarity,
                lk.threshold,
                lk.embed_ms,
                lk.lookup_ms,
            )
            r.entry_id = lk.entry.id if lk.entry else None
        r.prompt_tokens = usage.get("prompt_tokens")
        r.completion_tokens = usage.get("completion_tokens")
        r.cached_tokens = details.get("cached_tokens")
        r.status, r.error = status, error
        if r.cache_result not in (CacheResult.MISS, CacheResult.BYPASS):
            r.response_id = r.id  # a hit's body carries the request id
        if keys is not None:
            r.scope, r.system_hash = keys.scope, keys.system
        r.query_hash = query_hash(query) if query else None
        r.query = query[:QUERY_CHARS] if query and log_query and not self.cacheable.keeps_nothing else None
        return r
