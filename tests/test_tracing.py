"""Request traces: the gateway's spans (OpenTelemetry) and the headers every backend request carries.

A real gateway (SQLite, encoder, httpx) in front of a small recording upstream (testkit/servers.py), whose
point is the headers it receives; spans go to the SDK's in-memory exporter. One test puts the gateway in
front of the real built-in engine, one exports over real OTLP/HTTP to a small recording collector."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace import TracerProvider as SdkProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cachegw.gateway.api.app import build_app
from cachegw.gateway.compose import started_gateway
from cachegw.gateway.config import Settings, load_settings
from cachegw.gateway.request.flow import RequestTrace
from cachegw.gateway.request.tracing import Tracing, traces_url
from testkit.servers import Upstream, recording_upstream, serve_in_thread
from tests.test_gateway import MODEL, ask, settings_for

CLIENT_KEY = "sk-client-key-stays-here"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@contextlib.contextmanager
def gateway(settings: Settings, tracing: Tracing | None) -> Iterator[str]:
    app = build_app(lambda: started_gateway(settings, progress=False, tracing=tracing))
    with serve_in_thread(app, lifespan="on") as url:
        yield url


def post(url: str, text: str, stream: bool = False, model: str = "up", **headers: str) -> httpx.Response:
    body = {"model": model, "messages": ask(text), "temperature": 0, "max_tokens": 8, "stream": stream}
    auth = {"authorization": f"Bearer {CLIENT_KEY}", **headers}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    return r


def hexid(n: int, width: int) -> str:
    return format(n, f"0{width}x")


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]  # one of each per request
    return named


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def traceparent(headers: dict[str, str]) -> tuple[str, str]:
    """(trace id, parent span id) of a W3C traceparent header."""
    version, trace_id, parent, flags = headers["traceparent"].split("-")
    assert version == "00" and len(trace_id) == 32 and len(parent) == 16
    return trace_id, parent


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def tracing(exporter: InMemorySpanExporter) -> Tracing:
    provider = SdkProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # exported as each span ends
    return Tracing(provider)


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[Upstream, str]]:
    up = Upstream("up")
    with serve_in_thread(recording_upstream(up)) as url:
        yield up, url


@pytest.fixture(scope="module")
def traced(
    upstream: tuple[Upstream, str], tracing: Tracing, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    settings = settings_for(tmp_path_factory.mktemp("traced"), [f"{upstream[1]}/v1"])
    with gateway(settings, tracing) as url:
        yield url


@pytest.fixture
def fresh(exporter: InMemorySpanExporter, upstream: tuple[Upstream, str]) -> Upstream:
    """The upstream, with what it and the exporter saw so far forgotten."""
    exporter.clear()
    upstream[0].seen.clear()
    return upstream[0]


def test_a_miss_is_one_trace_and_the_backend_gets_its_parent_and_the_request_id(
    traced: str, fresh: Upstream, exporter: InMemorySpanExporter
) -> None:
    r = post(traced, "What colour is the sky on a clear day?")
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {"cachegw.request", "cachegw.lookup", "cachegw.backend", "cachegw.store"}
    request = spans["cachegw.request"]
    assert request.parent is None  # the client sent no trace: the gateway starts one
    trace_id = request.context.trace_id
    for name in ("cachegw.lookup", "cachegw.backend", "cachegw.store"):
        assert spans[name].context.trace_id == trace_id
        assert parent_id(spans[name]) == request.context.span_id
    a = attrs(request)
    assert a["cachegw.api"] == "chat" and a["cachegw.endpoint"] == "chat" and a["cachegw.model"] == "up"
    assert a["cachegw.cache_result"] == "miss" and a["http.response.status_code"] == 200
    assert a["cachegw.request_id"] == r.headers["x-request-id"] and a["cachegw.reason"] == "no-candidate"
    assert isinstance(a["cachegw.tenant"], str) and a["cachegw.tenant"]
    lookup = attrs(spans["cachegw.lookup"])
    assert lookup["cachegw.cache_result"] == "miss" and lookup["cachegw.reason"] == "no-candidate"
    backend = attrs(spans["cachegw.backend"])
    assert backend["cachegw.backend"].endswith("/v1") and backend["http.response.status_code"] == 200
    assert backend["cachegw.stream"] is False
    assert isinstance(attrs(spans["cachegw.store"])["cachegw.entry_id"], int)
    # what the backend was told: the request id the client got, and the backend call's span as parent
    [(_, _, headers, _)] = fresh.requests("/v1/chat/completions")
    assert headers["x-request-id"] == r.headers["x-request-id"]
    assert traceparent(headers) == (hexid(trace_id, 32), hexid(spans["cachegw.backend"].context.span_id, 16))
    assert CLIENT_KEY not in str(headers)  # the client's key still stays at the gateway


def test_a_hit_has_a_lookup_and_no_backend_call(
    traced: str, fresh: Upstream, exporter: InMemorySpanExporter
) -> None:
    post(traced, "Name the largest ocean.")
    exporter.clear()
    r = post(traced, "Name the largest ocean.")
    assert r.headers["x-cache"] == "exact-hit"
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {"cachegw.request", "cachegw.lookup"}
    assert attrs(spans["cachegw.request"])["cachegw.cache_result"] == "exact-hit"
    lookup = attrs(spans["cachegw.lookup"])
    assert lookup["cachegw.cache_result"] == "exact-hit" and lookup["cachegw.reason"] == "exact"
    assert len(fresh.requests("/v1/chat/completions")) == 1  # the first ask only


def test_a_client_traceparent_becomes_the_parent(
    traced: str, fresh: Upstream, exporter: InMemorySpanExporter
) -> None:
    sent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    post(traced, "How many legs has a spider?", traceparent=sent)
    spans = by_name(exporter.get_finished_spans())
    request = spans["cachegw.request"]
    assert request.parent is not None and request.parent.is_remote
    assert hexid(request.parent.span_id, 16) == CLIENT_SPAN
    assert {hexid(s.context.trace_id, 32) for s in spans.values()} == {CLIENT_TRACE}
    [(_, _, headers, _)] = fresh.requests("/v1/chat/completions")
    assert traceparent(headers) == (CLIENT_TRACE, hexid(spans["cachegw.backend"].context.span_id, 16))


def test_a_stream_is_traced_until_it_was_relayed(
    traced: str, fresh: Upstream, exporter: InMemorySpanExporter
) -> None:
    r = post(traced, "Say one word about rivers.", stream=True)
    assert "[DONE]" in r.text
    spans = by_name(exporter.get_finished_spans())  # ended before [DONE] was sent
    assert set(spans) == {"cachegw.request", "cachegw.lookup", "cachegw.backend", "cachegw.store"}
    backend = spans["cachegw.backend"]
    assert attrs(backend)["cachegw.stream"] is True
    assert attrs(backend)["http.response.status_code"] == 200
    assert backend.end_time is not None and spans["cachegw.store"].start_time is not None
    assert backend.end_time <= spans["cachegw.store"].start_time  # the store follows the relayed stream
    [(_, _, headers, _)] = fresh.requests("/v1/chat/completions")
    assert headers["x-request-id"] == r.headers["x-request-id"]
    assert traceparent(headers) == (
        hexid(backend.context.trace_id, 32),
        hexid(backend.context.span_id, 16),
    )


def test_a_refused_request_ends_its_span_with_the_status(
    traced: str, fresh: Upstream, exporter: InMemorySpanExporter
) -> None:
    r = httpx.post(f"{traced}/v1/chat/completions", json={"model": "up", "messages": "x"}, timeout=30)
    assert r.status_code == 400
    [span] = exporter.get_finished_spans()
    assert span.name == "cachegw.request"
    assert attrs(span)["http.response.status_code"] == 400
    assert fresh.seen == []


def test_unconfigured_tracing_records_nothing_and_passes_the_clients_trace_on(
    upstream: tuple[Upstream, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    off = Tracing.configured("")
    assert not off.enabled and not RequestTrace.begin(off.tracer, {}, "chat", "chat").span.is_recording()
    up, up_url = upstream
    up.seen.clear()
    settings = settings_for(tmp_path, [f"{up_url}/v1"])
    assert settings.gateway.otlp_endpoint == ""
    with gateway(settings, None) as url:
        plain = post(url, "Is water wet?")
        sent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
        post(url, "Is ice cold?", traceparent=sent, tracestate="vendor=1")
    first, second = up.requests("/v1/chat/completions")
    assert first[2]["x-request-id"] == plain.headers["x-request-id"]
    assert "traceparent" not in first[2]  # no trace anywhere: none invented
    assert second[2]["traceparent"] == sent and second[2]["tracestate"] == "vendor=1"


def test_spans_are_exported_over_otlp_http(
    upstream: tuple[Upstream, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    received: list[tuple[str, bytes]] = []
    collector = FastAPI()

    @collector.post("/v1/traces")
    async def traces(request: Request) -> dict:
        received.append((request.headers["content-type"], await request.body()))
        return {}

    with serve_in_thread(collector) as collector_url:
        settings = load_settings(
            None, data_dir=str(tmp_path), backends=(f"{upstream[1]}/v1",), otlp_endpoint=collector_url
        )
        with gateway(settings, None) as url:  # the gateway's own exporter, flushed when it stops
            r = post(url, "Which planet is red?")
    assert received and all(kind == "application/x-protobuf" for kind, _ in received)
    spans, services = [], set()
    for _, body in received:
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            named = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            services.add(named.get("service.name"))
            spans += [s for scope in resource_spans.scope_spans for s in scope.spans]
    assert services == {"cachegw"}
    names = {s.name for s in spans}
    assert {"cachegw.request", "cachegw.lookup", "cachegw.backend", "cachegw.store"} <= names
    [request] = [s for s in spans if s.name == "cachegw.request"]
    ids = {a.key: a.value.string_value for a in request.attributes}
    assert ids["cachegw.request_id"] == r.headers["x-request-id"]


def test_the_built_in_engine_receives_the_request_id_and_the_trace(
    shared_backend_url: str,
    tracing: Tracing,
    exporter: InMemorySpanExporter,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="cachegw.backend")
    exporter.clear()
    with gateway(settings_for(tmp_path, [shared_backend_url]), tracing) as url:
        r = post(url, f"Name a colour of the rainbow. {time.time()}", model=MODEL)
    assert r.headers["x-cache"] == "miss"
    # the engine names its answer after the request id it was sent
    assert r.json()["id"].startswith(f"chatcmpl-{r.headers['x-request-id']}-")
    backend = by_name(exporter.get_finished_spans())["cachegw.backend"]
    sent = f"00-{hexid(backend.context.trace_id, 32)}-{hexid(backend.context.span_id, 16)}-"  # then flags
    assert any(f"traceparent {sent}" in m for m in caplog.messages), caplog.messages[-5:]


def test_without_the_sdk_or_when_disabled_tracing_stays_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A configured endpoint is not a failed start: without the `otel` extra it is reported, and off."""
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with caplog.at_level(logging.WARNING, logger="cachegw.gateway"):
        assert not Tracing.configured("http://127.0.0.1:4318").enabled
    assert any("opentelemetry-sdk is missing" in m for m in caplog.messages)
    monkeypatch.undo()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not Tracing.configured("http://127.0.0.1:4318").enabled
