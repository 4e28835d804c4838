"""Traces of requests (OpenTelemetry): one span per request, with children for the cache lookup, the
backend call and the store, and the headers that carry the trace and the request id to the backend.

Off unless configured (``[gateway] otlp_endpoint`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``): the API's no-op
tracer then records and exports nothing, and a client's own ``traceparent`` still travels on to the
backend, so a trace the client started goes on past the gateway. The SDK and the OTLP exporter are the
``otel`` extra; without them a configured endpoint is reported once at start and tracing stays off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from opentelemetry.context import Context
from opentelemetry.trace import (
    NoOpTracerProvider,
    Span,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    TracerProvider,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.cache.lookup import Lookup
from gateway.storage.request_record import RequestRecord

log = logging.getLogger("cachegw.gateway")
T = TypeVar("T")
REQUEST_ID_HEADER = "x-request-id"
_W3C = TraceContextTextMapPropagator()  # traceparent/tracestate only: no baggage crosses the gateway
TRACES_PATH = "/v1/traces"


def _attrs(**values: Any) -> dict[str, Any]:
    """Span attributes without the unknown ones (OpenTelemetry refuses None)."""
    return {f"cachegw.{k}": v for k, v in values.items() if v is not None}


def traces_url(endpoint: str) -> str:
    """A collector's OTLP/HTTP traces URL from its base (as ``OTEL_EXPORTER_OTLP_ENDPOINT``) or full URL."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


class Tracing:
    """The gateway's tracer: a real one over ``provider``, else the API's no-op one (negligible cost)."""

    def __init__(
        self, provider: TracerProvider | None = None, shutdown: Callable[[], object] | None = None
    ) -> None:
        self.enabled = provider is not None
        self.tracer: Tracer = (provider or NoOpTracerProvider()).get_tracer("cachegw")
        self._shutdown = shutdown

    @classmethod
    def configured(cls, endpoint: str) -> Tracing:
        """Spans exported over OTLP/HTTP to ``endpoint``, else to the standard environment variables'
        collector; off when neither names one (or ``OTEL_SDK_DISABLED=true``)."""
        env = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        if not (endpoint or env) or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return cls()
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider as SdkProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            log.warning("tracing is configured but opentelemetry-sdk is missing: pip install 'cachegw[otel]'")
            return cls()
        # the exporter reads the environment itself when no endpoint is given here
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint)) if endpoint else OTLPSpanExporter()
        name = os.environ.get("OTEL_SERVICE_NAME") or "cachegw"
        provider = SdkProvider(resource=Resource.create({"service.name": name}))
        provider.add_span_processor(BatchSpanProcessor(exporter))  # off the request path
        log.info("tracing: spans exported over OTLP/HTTP to %s", traces_url(endpoint) if endpoint else env)
        return cls(provider, provider.shutdown)

    def begin(self, headers: Mapping[str, str], api: str, endpoint: str) -> RequestTrace:
        """The request's span, a child of the client's ``traceparent`` when it sent one."""
        return RequestTrace(self.tracer, _W3C.extract(headers), api, endpoint)

    def shutdown(self) -> None:
        """Export what is still buffered; the caller that built the provider calls this once."""
        if self._shutdown is not None:
            self._shutdown()


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
