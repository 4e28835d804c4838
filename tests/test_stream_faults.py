"""A stream the backend breaks: the client gets an OpenAI-style error event, the log a 502, the cache nothing.

The backend here is a small OpenAI-compatible test server, not the built-in engine: it breaks its
stream on purpose after two chunks (the connection torn mid-body, or closed before ``[DONE]``), a
fault the real engine cannot be made to produce at a chosen point.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tests.servers import serve_in_thread
from tests.test_gateway import gateway, settings_for

MODEL = "faulty"


def faulty_backend(calls: list[str]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        how = body["messages"][-1]["content"]
        calls.append(how)

        async def events():
            for word in ("Half ", "an answer"):
                chunk = {
                    "id": "chatcmpl-x",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": MODEL,
                    "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}],
                }
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            if how == "tear":
                raise RuntimeError("the engine died")  # uvicorn drops the connection mid-body
            # "close": the body ends cleanly, but without a finish_reason or [DONE]

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def faulty() -> Iterator[tuple[str, list[str]]]:
    calls: list[str] = []
    with serve_in_thread(faulty_backend(calls)) as url:
        yield f"{url}/v1", calls


def stream(url: str, how: str) -> tuple[int, str, list[dict]]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": how}],
        "temperature": 0,
        "stream": True,
    }
    headers = {"authorization": "Bearer tenant-a"}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        events = [
            json.loads(line[5:])
            for line in r.iter_lines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"
        ]
        return r.status_code, r.headers["x-cache"], events


def logged(data_dir: Path, n: int) -> list[tuple[int, str]]:
    deadline = time.monotonic() + 10
    while True:
        with sqlite3.connect(data_dir / "cachegw.db") as db:
            rows = db.execute("SELECT status, error FROM requests ORDER BY ts").fetchall()
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["tear", "close"])
def test_a_broken_stream_ends_with_an_error_event_is_logged_502_and_never_stored(
    faulty: tuple[str, list[str]], tmp_path: Path, how: str
) -> None:
    backend, calls = faulty
    before = len(calls)
    with gateway(settings_for(tmp_path, [backend])) as url:
        status, cache, events = stream(url, how)
        assert status == 200 and cache == "miss"
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "Half an answer"
        error = events[-1]["error"]
        assert error["code"] == "backend_error" and error["type"] == "server_error"
        assert set(error) == {"message", "type", "param", "code"}
        # nothing stored: the same request goes to the backend again
        _, cache2, _ = stream(url, how)
        assert cache2 == "miss" and len(calls) == before + 2
        rows = logged(tmp_path, 2)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert len(rows) == 2
    for status_logged, error_logged in rows:
        assert status_logged == 502
        assert error_logged.startswith("backend_error: stream broke after ")
        assert int(error_logged.split(" after ")[1].split()[0]) > 0  # the bytes relayed are counted
    assert 'cachegw_gateway_errors_total{code="backend_error",status="502"} 2.0' in metrics
    assert 'status="500"' not in metrics
