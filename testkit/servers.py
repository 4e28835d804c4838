"""Test and benchmark helpers: run an ASGI app with uvicorn on a free loopback port in a background thread;
a small OpenAI-compatible upstream that records what it is sent and can be made to hang; a
gateway config on the pgvector store; a throwaway Redis server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


@contextlib.contextmanager
def serve_in_thread(
    app, lifespan: Literal["auto", "on", "off"] = "off", start_timeout: float = 120.0, port: int = 0
) -> Iterator[str]:
    """Yields the base URL (http://127.0.0.1:PORT) while the server runs; stops it afterwards.

    ``port`` 0 picks a free one; a fixed one lets a test bring a server up where a client already points."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    port = sock.getsockname()[1]
    # a connection still open at the end (a stream a test left) must not hold the stop for long
    config = uvicorn.Config(app, log_level="warning", lifespan=lifespan, timeout_graceful_shutdown=3)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        release_fastapi_caches()


def release_fastapi_caches() -> None:
    """FastAPI keeps endpoint callables in module-level LRU caches (4096 entries); for apps built from
    bound methods, as the backend and gateway are, that kept every stopped server's engine or gateway
    (weights, KV cache, encoder) alive for the rest of the run. Clearing them only costs a re-check."""
    from fastapi.dependencies import models

    for value in vars(models).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def pgvector_config(folder: Path, upstream: str, database: str) -> Path:
    """A gateway config on the pgvector store in front of ``upstream`` (the MLP verifier alone: hits
    cost less, so a test or benchmark spends its time where it means to)."""
    path = folder / "cachegw.toml"
    path.write_text(
        f'[gateway]\nbackends = ["{upstream}/v1"]\ndatabase_url = "{database}"\n'
        '[index]\nstore = "pgvector"\n[cache.verifier]\ncross_verifier = false\n'
    )
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Upstream:
    """What a ``recording_upstream`` saw, and a switch that makes it hang."""

    model: str
    answer: str = "blue"
    seen: list[tuple[str, str, dict[str, str], bytes]] = field(
        default_factory=list
    )  # method, path, headers, body
    hang: bool = False  # while True every request waits, unanswered (as a SIGSTOPped server)
    stall_streams: bool = False  # while True a stream stops after its first chunk

    def requests(self, path: str) -> list[tuple[str, str, dict[str, str], bytes]]:
        return [r for r in self.seen if r[1] == path]


def recording_upstream(up: Upstream) -> FastAPI:
    """A small OpenAI-compatible server for faults and credentials the built-in engine cannot show:
    it records every request's headers and can be made to hang (tests say where they use it)."""
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next):  # type: ignore[no-untyped-def]
        body = await request.body()
        up.seen.append((request.method, request.url.path, dict(request.headers), body))
        while up.hang:
            await asyncio.sleep(0.02)
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": up.model, "object": "model", "owned_by": "test"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        if (await request.json()).get("stream"):
            return StreamingResponse(stream(), media_type="text/event-stream")
        message = {"role": "assistant", "content": up.answer}
        return {
            "id": f"chatcmpl-{len(up.seen)}",
            "object": "chat.completion",
            "created": 0,
            "model": up.model,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }

    async def stream() -> AsyncIterator[bytes]:
        def chunk(delta: dict, finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            body = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 0, "model": up.model}
            return b"data: " + json.dumps({**body, "choices": [choice]}).encode() + b"\n\n"

        yield chunk({"role": "assistant", "content": up.answer})
        while up.stall_streams:
            await asyncio.sleep(0.02)
        yield chunk({}, "stop")
        yield b"data: [DONE]\n\n"

    return app


REDIS_SERVER = "/usr/bin/redis-server"


def redis_available() -> bool:
    return shutil.which(REDIS_SERVER) is not None


@contextlib.contextmanager
def redis_server(maxmemory: str = "256mb") -> Iterator[str]:
    """A real ``redis-server`` on a free loopback port, its files in a temporary folder, no persistence,
    least recently used keys dropped past ``maxmemory``; yields its URL (``redis://127.0.0.1:PORT/0``)."""
    import redis

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="cachegw-redis-") as folder:
        args = [
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            folder,
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        args += ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
        proc = subprocess.Popen([REDIS_SERVER, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url)
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.05)
            yield url
        finally:
            client.close()
            proc.terminate()
            proc.wait(10)
