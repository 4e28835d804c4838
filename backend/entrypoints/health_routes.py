"""Kubernetes-style probes of the engine's server: ``/health/live`` (the process serves HTTP) and
``/health/ready`` (the model is loaded and the engine's loop runs, so a request can be answered)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse


def add_health_routes(app: FastAPI, engine_alive: Callable[[], bool]) -> None:
    async def live() -> JSONResponse:
        return JSONResponse({"status": "live"})

    async def ready() -> JSONResponse:
        # the server is built over an engine that has loaded its model: alive means loaded and running
        if engine_alive():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not_ready", "not_ready": ["engine"]}, status_code=503)

    app.add_api_route("/health/live", live, methods=["GET"])
    app.add_api_route("/health/ready", ready, methods=["GET"])
