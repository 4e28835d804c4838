"""The gateway's HTTP app: the OpenAI routes, feedback, health and metrics, and the admin router.

Routes declare the parts they use (``gateway/api/deps.py``); the request pipeline itself is
``gateway/request/pipeline.py``.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cachegw.gateway.api.admin_api import admin_router, dashboard_page, json_body
from cachegw.gateway.api.deps import (
    AuthDep,
    BackendsDep,
    CacheDep,
    MetricsDep,
    ReportsDep,
    SettingsDep,
    TenantsDep,
    started,
)
from cachegw.gateway.api.embeddings_api import embeddings_router
from cachegw.gateway.api.health_api import health_router
from cachegw.gateway.api.messages_api import messages_router
from cachegw.gateway.api.metrics_http import metrics_response
from cachegw.gateway.api.responses_api import responses_router
from cachegw.gateway.cache.feedback import parse_feedback
from cachegw.gateway.parts import Parts
from cachegw.protocol.errors import ApiError
from cachegw.protocol.http import install_error_handlers


def build_app(parts_factory) -> FastAPI:
    """``parts_factory`` is an async context manager yielding the started ``Parts`` (gateway/compose.py)."""
    state: dict[str, Parts] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async with parts_factory() as parts:
            state["parts"] = parts
            yield

    # /openapi.json documents the API; FastAPI's /docs pages would load their scripts from a CDN.
    app = FastAPI(title="cachegw gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    # what the providers of gateway/api/deps.py read; also the separate metrics listener's way in
    # (a bound builtin, not a lambda: a request's path never calls back into this file)
    app.state.parts = partial(state.get, "parts")
    install_error_handlers(
        app, lambda status, code: state["parts"].metrics.count_error(status, code) if state else None
    )

    # The two hot routes first (routes match in order) and without dependency injection: FastAPI's
    # solving of even one dependency cost about a tenth of an exact hit's time.
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await started(request).pipeline.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await started(request).pipeline.handle(request, "completions")

    app.include_router(admin_router())
    app.include_router(responses_router())
    app.include_router(embeddings_router())
    app.include_router(health_router())  # /health/live, /health/ready (Kubernetes probes)
    app.include_router(messages_router())  # Anthropic's /v1/messages, through the chat pipeline

    @app.get("/admin", include_in_schema=False)
    async def dashboard() -> Response:
        return dashboard_page()

    @app.post("/v1/cache/feedback")
    async def feedback(request: Request, tenants: TenantsDep, reports: ReportsDep) -> dict[str, Any]:
        """A tenant flags one of its own answers as bad (by the response id or x-request-id, or the
        x-cache-entry id of a hit)."""
        tenant = tenants.from_headers(request.headers)
        request_id, entry_id = parse_feedback(await json_body(request), admin=False)
        return await reports.report_bad(f"tenant:{tenant.name[:16]}", request_id, entry_id, tenant=tenant.id)

    @app.get("/v1/models")
    async def models(request: Request, tenants: TenantsDep, backends: BackendsDep) -> dict[str, Any]:
        tenants.from_headers(request.headers)
        return {"object": "list", "data": await backends.list_models()}

    @app.get("/health")
    async def health(request: Request, auth: AuthDep, b: BackendsDep, cache: CacheDep) -> JSONResponse:
        """Liveness for anyone; counts and backend addresses only with the admin token (they tell
        other tenants' activity). 503 "degraded" while a served model has no reachable backend:
        cached answers are still served on the API routes."""
        unreachable = b.unreachable_models()
        status = "degraded" if unreachable else "ok"
        body: dict[str, Any] = {"status": status}
        try:
            auth.check(request.headers.get("authorization"))
        except ApiError:
            return JSONResponse(body, status_code=503 if unreachable else 200)
        body |= {
            "unreachable_models": unreachable,
            "backends": b.urls,
            "backends_refusing": b.refusing(),
            "backends_down": sorted(b.down),  # by the health probes (docs/reliability.md)
            "cache_entries": cache.entries,
            "index_entries": len(cache.index),  # vectors this replica searches (docs/replicas.md)
        }
        return JSONResponse(body, status_code=503 if unreachable else 200)

    @app.get("/metrics")
    async def metrics(request: Request, settings: SettingsDep, m: MetricsDep) -> Response:
        """Prometheus; 404 here when ``metrics_port`` serves it elsewhere (gateway/api/metrics_http.py)."""
        return metrics_response(settings.gateway, m, request, own_port=False)

    return app
