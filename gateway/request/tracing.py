"""Traces of requests (OpenTelemetry): the tracer and where its spans go. The spans of one request (its
lookup, backend call and store, and the headers that carry the trace to the backend) are
``gateway.request.flow.RequestTrace``: they travel with the request in flight.

Off unless configured (``[gateway] otlp_endpoint`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``): the API's no-op
tracer then records and exports nothing, and a client's own ``traceparent`` still travels on to the
backend, so a trace the client started goes on past the gateway. The SDK and the OTLP exporter are the
``otel`` extra; without them a configured endpoint is reported once at start and tracing stays off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from opentelemetry.trace import NoOpTracerProvider, Tracer, TracerProvider

log = logging.getLogger("cachegw.gateway")
TRACES_PATH = "/v1/traces"


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

    def shutdown(self) -> None:
        """Export what is still buffered; the caller that built the provider calls this once."""
        if self._shutdown is not None:
            self._shutdown()
