"""Kubernetes-style probes: ``/health/live`` and ``/health/ready`` on the gateway (gateway/api/health_api.py)
and on the built-in engine's server (backend/entrypoints/health_routes.py).

Ready fails when the database stops answering (a real PostgreSQL database dropped under the gateway),
not when a backend is down: cached answers still serve, and readiness only reports it."""

from __future__ import annotations

from pathlib import Path

import httpx
from fastapi import FastAPI

from cachegw.backend.entrypoints.health_routes import add_health_routes
from testkit.servers import serve_in_thread
from tests.test_gateway import gateway, settings_for
from tests.test_health import ask, tiny_backend
from tests.test_shared_store import fresh_database


def get(url: str, path: str, token: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{url}{path}", headers=headers, timeout=30)


def test_ready_reports_a_down_backend_without_failing(tmp_path: Path) -> None:
    server = serve_in_thread(tiny_backend())
    backend = f"{server.__enter__()}/v1"
    try:
        with gateway(settings_for(tmp_path, [backend])) as url:
            token = (tmp_path / "admin_token").read_text().strip()
            assert get(url, "/health/live").json() == {"status": "live"}
            ready = get(url, "/health/ready")
            assert ready.status_code == 200
            assert ready.json() == {"status": "ready", "unreachable_models": []}  # no addresses for anyone
            assert get(url, "/health/ready", token).json()["backends_down"] == []
            assert ask(url, "Sky colour?").status_code == 200
            server.__exit__(None, None, None)  # the only backend goes away
            assert ask(url, "Grass colour?").status_code == 502
            ready = get(url, "/health/ready")
            assert ready.status_code == 200 and ready.json()["unreachable_models"] == ["m"]
            assert get(url, "/health").status_code == 503  # /health says degraded, as before
            assert ask(url, "Sky colour?").headers["x-cache"] == "exact-hit"  # what ready promised
    finally:
        server.__exit__(None, None, None)


def test_ready_fails_while_the_database_does_not_answer(tmp_path: Path, postgres: str) -> None:
    import psycopg

    database = fresh_database(postgres)
    settings = settings_for(tmp_path, ["http://127.0.0.1:9/v1"])  # a backend that never answers
    settings = settings.model_copy(
        update={"gateway": settings.gateway.model_copy(update={"database_url": database})}
    )
    with gateway(settings) as url:
        assert get(url, "/health/ready").status_code == 200  # a down backend alone: still ready
        name = database.rsplit("/", 1)[1]
        dsn = postgres.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(dsn, autocommit=True) as conn:  # the database goes, connections with it
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)")
        ready = get(url, "/health/ready")
        assert ready.status_code == 503
        assert ready.json()["status"] == "not_ready" and ready.json()["not_ready"] == ["database"]
        assert get(url, "/health/live").status_code == 200  # a restart would not bring it back


def test_engine_server_probes(shared_backend_url: str) -> None:
    base = shared_backend_url.removesuffix("/v1")
    assert get(base, "/health/live").json() == {"status": "live"}
    ready = get(base, "/health/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    app = FastAPI()  # the same routes over an engine whose loop has stopped
    add_health_routes(app, lambda: False)
    with serve_in_thread(app) as url:
        gone = get(url, "/health/ready")
        assert gone.status_code == 503 and gone.json()["not_ready"] == ["engine"]
        assert get(url, "/health/live").status_code == 200
