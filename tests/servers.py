"""Test helper: run an ASGI app with uvicorn on a free loopback port in a background thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn


@contextlib.contextmanager
def serve_in_thread(app, lifespan: str = "off", start_timeout: float = 120.0, port: int = 0) -> Iterator[str]:
    """Yields the base URL (http://127.0.0.1:PORT) while the server runs; stops it afterwards.

    ``port`` 0 picks a free one; a fixed one lets a test bring a server up where a client already points."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
