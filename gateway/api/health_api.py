"""Kubernetes-style probes: ``/health/live`` (the process serves HTTP) and ``/health/ready`` (it can
answer: the database replies and the composition root has finished, the vector index loaded).

A backend that is down does not make the gateway unready: cached answers are still served, and
taking the pod out of its Service would lose them too. Readiness reports it (``unreachable_models``
for anyone; ``backends_down`` with the admin token, as ``/health`` shows addresses only to the admin).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from cachegw.gateway.parts import Parts
from cachegw.protocol.errors import ApiError

log = logging.getLogger("cachegw.gateway")
DATABASE_TIMEOUT_S = 2.0  # a database slower than this to answer SELECT 1 counts as not ready


async def _database_answers(parts: Parts) -> bool:
    try:
        await asyncio.wait_for(asyncio.to_thread(parts.admin.ping), DATABASE_TIMEOUT_S)
        return True
    except Exception as exc:  # noqa: BLE001 - any failure means not ready; logged, never shown
        log.warning("readiness: the database did not answer: %s", type(exc).__name__)
        return False


def health_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health/live")
    async def live() -> dict[str, str]:
        """200 while the process serves HTTP; checks nothing else (a restart would not fix a database)."""
        return {"status": "live"}

    @router.get("/health/ready")
    async def ready(request: Request) -> JSONResponse:
        """200 when requests can be answered; 503 naming what is not ready (``not_ready``)."""
        parts: Parts | None = request.app.state.parts()
        if parts is None:  # the composition root has not finished (or is stopping)
            return JSONResponse({"status": "not_ready", "not_ready": ["cache"]}, status_code=503)
        body: dict[str, Any] = {"status": "ready", "unreachable_models": parts.backends.unreachable_models()}
        try:
            parts.auth.check(request.headers.get("authorization"))
            body["backends_down"] = sorted(parts.backends.down)
        except ApiError:
            pass
        if not await _database_answers(parts):
            return JSONResponse(body | {"status": "not_ready", "not_ready": ["database"]}, status_code=503)
        return JSONResponse(body)

    return router
