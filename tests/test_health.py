"""/health: liveness for anyone, details for the admin, and 503 "degraded" while a served model has no
reachable backend (cached answers still served).

The backend is a small OpenAI-compatible test server so that it can be stopped mid-test in a blink;
the built-in engine behaves the same once gone (tests/test_routing.py stops a real one)."""

from __future__ import annotations

from pathlib import Path

import httpx
from fastapi import FastAPI

from testkit.servers import serve_in_thread
from tests.test_gateway import gateway, settings_for


def tiny_backend() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "test"}]}

    @app.post("/v1/chat/completions")
    async def chat() -> dict:
        message = {"role": "assistant", "content": "blue"}
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }

    return app


def ask(url: str, question: str) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": question}], "temperature": 0}
    return httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"authorization": "Bearer t"}, timeout=30
    )


def test_health_is_liveness_for_anyone_and_degraded_when_no_backend_answers(tmp_path: Path) -> None:
    server = serve_in_thread(tiny_backend())
    backend = f"{server.__enter__()}/v1"
    try:
        with gateway(settings_for(tmp_path, [backend])) as url:
            admin = {"authorization": f"Bearer {(tmp_path / 'admin_token').read_text().strip()}"}
            assert ask(url, "Sky colour?").json()["choices"][0]["message"]["content"] == "blue"
            anonymous = httpx.get(f"{url}/health", timeout=30)
            assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok"}  # no counts
            detailed = httpx.get(f"{url}/health", headers=admin, timeout=30).json()
            assert detailed["cache_entries"] == 1 and detailed["backends"] == [backend]
            server.__exit__(None, None, None)  # the only backend goes away
            assert ask(url, "Grass colour?").status_code == 502  # a miss: refused
            down = httpx.get(f"{url}/health", timeout=30)
            assert down.status_code == 503 and down.json() == {"status": "degraded"}
            detailed = httpx.get(f"{url}/health", headers=admin, timeout=30).json()
            assert detailed["unreachable_models"] == ["m"] and detailed["backends_refusing"] == [backend]
            hit = ask(url, "Sky colour?")  # cached answers keep being served
            assert hit.status_code == 200 and hit.headers["x-cache"] == "exact-hit"
    finally:
        server.__exit__(None, None, None)
