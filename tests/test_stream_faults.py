"""A stream the backend breaks: the client gets an OpenAI-style error event, the log a 502, the cache nothing.

The backend here is a small OpenAI-compatible test server, not the built-in engine: it breaks its
stream on purpose after two chunks (the connection torn mid-body, or closed before ``[DONE]``), a
fault the real engine cannot be made to produce at a chosen point.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from testkit.servers import serve_in_thread
from tests.test_gateway import gateway, settings_for

MODEL = "faulty"
RELEASE = threading.Event()  # lets the "crlf" stream send its second half


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

        def chunk(delta: dict, finish: str | None = None) -> str:
            body = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
            return json.dumps({**body, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

        async def events():
            if how == "crlf":  # framed with CRLF, as the SSE spec allows; a whole, good answer
                for i, word in enumerate(("Half ", "an answer")):
                    if i:  # until the test has read the first event; 10 s at most, then end badly
                        for _ in range(1000):
                            if RELEASE.is_set():
                                break
                            await asyncio.sleep(0.01)
                        else:
                            return
                    yield f"data: {chunk({'content': word})}\r\n\r\n".encode()
                yield f"data: {chunk({}, 'stop')}\r\n\r\ndata: [DONE]\r\n\r\n".encode()
                return
            for word in ("Half ", "an answer"):
                yield f"data: {chunk({'content': word})}\n\n".encode()
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


def ask(how: str) -> dict:
    """A streamed request; its text tells the test backend how to answer."""
    return {"model": MODEL, "messages": [{"role": "user", "content": how}], "temperature": 0, "stream": True}


def stream(url: str, how: str) -> tuple[int, str, list[dict]]:
    body = ask(how)
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


def test_a_crlf_framed_stream_is_relayed_event_by_event_and_stored(
    faulty: tuple[str, list[str]], tmp_path: Path
) -> None:
    """The first event reaches the client while the backend still holds the rest back (the gateway split
    on LF-LF only and held a CRLF stream to its end: this waited for a release that never came)."""
    backend, _ = faulty
    RELEASE.clear()
    body = ask("crlf")
    with gateway(settings_for(tmp_path, [backend])) as url:
        auth = {"authorization": "Bearer tenant-a"}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=auth, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert json.loads(first[5:])["choices"][0]["delta"]["content"] == "Half "
            RELEASE.set()
            rest = [line[5:].strip() for line in lines if line.startswith("data:")]
        assert rest[-1] == "[DONE]"
        status, cache, events = stream(url, "crlf")  # stored whole: the repeat is a hit
    assert status == 200 and cache == "exact-hit"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "Half an answer"


@pytest.mark.parametrize("framing", [b"\n", b"\r\n", b"\r"])
def test_the_event_splitter_reads_every_line_ending_across_any_chunking(framing: bytes) -> None:
    from cachegw.protocol.sse import EventSplitter, data_of

    stream_bytes = b"".join(b"data: " + w + framing + framing for w in (b"one", b"two", b"[DONE]"))
    for size in (1, 2, 3, 7, len(stream_bytes)):
        splitter = EventSplitter()
        chunks = [stream_bytes[i : i + size] for i in range(0, len(stream_bytes), size)]
        events = [e for chunk in chunks for e in splitter.feed(chunk)] + splitter.close()
        assert [data_of(e) for e in events] == [b"one", b"two", b"[DONE]"], (framing, size)
        assert splitter.rest == b""


def test_a_client_that_goes_away_mid_stream_is_logged_and_nothing_is_stored(
    faulty: tuple[str, list[str]], tmp_path: Path
) -> None:
    """The gateway finishes the request's bookkeeping in a task of its own once the client is gone (the
    pipeline keeps a reference to it, so it cannot be collected mid-run): the row is written, the half
    answer is not stored."""
    backend, _ = faulty
    RELEASE.clear()
    body = ask("crlf")
    auth = {"authorization": "Bearer tenant-a"}
    with gateway(settings_for(tmp_path, [backend])) as url:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=auth, timeout=60) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data:"))
            assert json.loads(first[5:])["choices"][0]["delta"]["content"] == "Half "
        # the client closed the connection with the backend's answer half sent
        rows = logged(tmp_path, 1)
        RELEASE.set()
        assert rows == [(200, "stream incomplete or failed: not stored")]
        _, cache, _ = stream(url, "crlf")
    assert cache == "miss"
