"""Serving Prometheus ``/metrics``: behind ``[gateway] metrics_token``, on the gateway's port or on
its own (``metrics_host``/``metrics_port``, a second listener in the same process).

The metrics tell request counts by result and the cache's size: activity a tenant should not read.
A token keeps anyone without it out; a separate address keeps the route off the port tenants reach.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import Response

from cachegw.gateway.request.admin_auth import AdminAuth
from cachegw.protocol.errors import ApiError
from cachegw.protocol.http import install_error_handlers

if TYPE_CHECKING:
    from cachegw.gateway.config import GatewayConfig
    from cachegw.gateway.metrics import GatewayMetrics
    from cachegw.gateway.parts import Parts

CONTENT_TYPE = "text/plain; version=0.0.4"


def metrics_response(g: GatewayConfig, metrics: GatewayMetrics, request: Request, own_port: bool) -> Response:
    """The scrape, after the checks: served where the config says, with its token when it has one."""
    if bool(g.metrics_port) != own_port:  # not on this listener: as if the route did not exist
        raise ApiError(404, f"Invalid URL ({request.method} {request.url.path})")
    if g.metrics_token:
        AdminAuth(g.metrics_token, what="metrics").check(request.headers.get("authorization"))
    return Response(metrics.render(), media_type=CONTENT_TYPE)


def metrics_app(get_parts: Callable[[], Parts | None]) -> FastAPI:
    """The app of the separate metrics listener: ``/metrics`` only (503 until the gateway started)."""
    app = FastAPI(title="cachegw metrics", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        parts = get_parts()
        if parts is None:
            raise ApiError(503, "The gateway is starting.", type="server_error", code="starting")
        return metrics_response(parts.settings.gateway, parts.metrics, request, own_port=True)

    return app
