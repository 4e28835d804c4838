"""The chaos run's clients (bench/chaos.py): steady traffic, and long streams to cut.

Each request is kept as an ``Outcome``, what its client saw: status, cache result, text, and for a
stream whether it ended with [DONE], with the gateway's SSE error event, or with nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}
THINGS = ("fruit", "color", "planet", "river", "tree", "bird", "metal", "ocean")
POOL = [f"Name a {thing}." for thing in THINGS]  # asked again and again: hits
MAX_TOKENS = 16
RETRY_S = 0.25  # a client's pause after a failure


@dataclass
class Outcome:
    """One request as its client saw it."""

    start: float
    end: float
    question: str
    stream: bool
    status: int | str  # HTTP status, or "connect" / "read" for a transport failure
    x_cache: str = ""
    request_id: str = ""
    text: str = ""
    stream_end: str = ""  # "done", "error-event", "dropped" (streams only)

    @property
    def ok(self) -> bool:
        return self.status == 200 and (not self.stream or self.stream_end == "done")

    @property
    def failure(self) -> str:
        """How it failed, for the report: an HTTP status, "connect"/"read", or how a stream ended."""
        return str(self.status) if self.status != 200 else f"stream-{self.stream_end}"


def ask(client: httpx.Client, url: str, question: str, stream: bool, max_tokens: int = MAX_TOKENS) -> Outcome:
    body = {
        "model": MODEL,
        "messages": [SYSTEM, {"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
    }
    out = Outcome(time.monotonic(), 0.0, question, stream, "connect")
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            out.status, out.x_cache = r.status_code, r.headers.get("x-cache", "")
            out.request_id = r.headers.get("x-request-id", "")
            if stream and r.status_code == 200:
                read_stream(r, out)
            else:
                data = json.loads(r.read() or b"{}")
                out.text = ((data.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
    except httpx.ConnectError:
        out.status = "connect"
    except (httpx.HTTPError, json.JSONDecodeError):
        if not out.stream_end:  # a stream that broke keeps its 200 and says how it ended
            out.status = "read"
    out.end = time.monotonic()
    return out


def read_stream(r: httpx.Response, out: Outcome, on_first: Callable[[], None] | None = None) -> None:
    """Collect the text; ``stream_end`` says whether [DONE], an SSE error event or nothing came."""
    out.stream_end = "dropped"
    for line in r.iter_lines():
        if line == "data: [DONE]":
            out.stream_end = "done"
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            if "error" in event:
                out.stream_end = "error-event"
            for choice in event.get("choices") or []:
                out.text += (choice.get("delta") or {}).get("content") or ""
            if on_first is not None and out.text:
                on_first()
                on_first = None


class Load:
    """Steady traffic from four threads; every outcome kept for the report."""

    def __init__(self, url: str) -> None:
        self.url, self.lock = url, threading.Lock()
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self.counter = 0
        self.threads = [threading.Thread(target=self._misses, args=(i,), daemon=True) for i in range(2)]
        self.threads += [threading.Thread(target=self._hits, args=(i,), daemon=True) for i in range(2)]

    def add(self, out: Outcome) -> None:
        with self.lock:
            self.outcomes.append(out)

    def _misses(self, worker: int) -> None:
        with httpx.Client(timeout=90) as client:
            while not self.stop.is_set():
                with self.lock:
                    self.counter += 1
                    n = self.counter
                out = ask(client, self.url, f"Give one fact about the number {1000 + n}.", stream=n % 2 == 0)
                self.add(out)
                time.sleep(0 if out.ok else RETRY_S)

    def _hits(self, worker: int) -> None:
        i = worker
        with httpx.Client(timeout=90) as client:
            while not self.stop.is_set():
                i += 1
                out = ask(client, self.url, POOL[i % len(POOL)], stream=i % 3 == 0)
                self.add(out)
                time.sleep(0.05 if out.ok else RETRY_S)

    def since(self, t: float) -> list[Outcome]:
        with self.lock:
            return [o for o in self.outcomes if o.start >= t]


def wait_at(barrier: threading.Barrier) -> None:
    barrier.wait(60)


def long_streams(url: str, tag: str, n: int, started: threading.Barrier) -> tuple[list, list]:
    """``n`` long streams, each waiting at ``started`` once its first words arrived; (outcomes, threads)."""
    results: list[Outcome] = []

    def one(i: int) -> None:
        question = f"Write a long story about a lighthouse keeper, {tag} part {i}."
        out = Outcome(time.monotonic(), 0.0, question, True, "connect")
        messages = [SYSTEM, {"role": "user", "content": question}]
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "temperature": 0}
        body |= {"max_tokens": 400, "stream": True}
        try:
            with (
                httpx.Client(timeout=90) as c,
                c.stream("POST", f"{url}/v1/chat/completions", json=body) as r,
            ):
                out.status, out.request_id = r.status_code, r.headers.get("x-request-id", "")
                read_stream(r, out, on_first=lambda: wait_at(started))
        except (httpx.HTTPError, threading.BrokenBarrierError):
            pass
        finally:
            if not out.text:
                started.abort()
        out.end = time.monotonic()
        results.append(out)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return results, threads
