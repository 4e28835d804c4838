"""The request path reads top to bottom: a chat completion's walk through the gateway's files, traced.

A profiler records every call into our packages while a real gateway (in front of the real built-in
engine) answers a miss and then a semantic hit. Two properties are checked, and the walk itself is
compared with the one docs/architecture.md lists, so that page stays true:

- no file is entered twice on one call stack (a deeper file never calls back into a file it came
  from: no back and forth), for every call of the request;
- the files a request passes through, in the order it first enters them, until the backend call (a
  miss) or the stored answer (a semantic hit), are the ones docs/architecture.md lists.
"""

from __future__ import annotations

import contextvars
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from cachegw.gateway.api.app import build_app
from cachegw.gateway.compose import started_gateway
from testkit.servers import serve_in_thread
from tests.test_gateway import ask, chat, settings_for

ROOT = Path(__file__).resolve().parents[1]
# our modules run from cachegw/<package>/ (links to the top-level folders): named by the folder's path
PACKAGES = ("gateway", "policies", "embeddings", "protocol")
OURS = tuple(str(base / p) + "/" for base in (ROOT / "cachegw", ROOT) for p in PACKAGES)
DOC = ROOT / "docs" / "architecture.md"
pytestmark = pytest.mark.slow
# Set for the calls a traced HTTP request makes (tasks and worker threads copy it), so the gateway's
# background chores (health probes, the log writer) never enter the walk.
IN_REQUEST: contextvars.ContextVar[bool] = contextvars.ContextVar("in_request", default=False)


class Marked:
    """The ASGI app, with every HTTP request's context marked."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            IN_REQUEST.set(True)
        await self.app(scope, receive, send)


def _ours(frame: FrameType) -> str | None:
    name = frame.f_code.co_filename
    if not name.startswith(OURS):
        return None
    return Path(name).relative_to(ROOT).as_posix().removeprefix("cachegw/")


class PathTrace:
    """Records, while on, each of our files in the order first entered, and every call stack on
    which one of our files appears twice with another between (a re-entry)."""

    def __init__(self) -> None:
        self.on = False
        self.order: list[str] = []
        self.reentries: set[tuple[str, ...]] = set()
        self.ends: dict[str, int] = {}  # a function's name -> how many files were entered when it ran
        self.lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call" or not IN_REQUEST.get():
            return
        here = _ours(frame)
        if here is None:
            return
        chain: list[str] = []
        f: FrameType | None = frame
        while f is not None:
            name = _ours(f)
            if name is not None and (not chain or chain[-1] != name):
                chain.append(name)
            f = f.f_back
        chain.reverse()
        with self.lock:
            if here not in self.order:
                self.order.append(here)
            self.ends.setdefault(frame.f_code.co_name, len(self.order))
            if len(set(chain)) != len(chain):
                self.reentries.add(tuple(chain))

    def start(self) -> None:
        self.order, self.reentries, self.ends, self.on = [], set(), {}, True

    def walk(self, until: tuple[str, ...]) -> list[str]:
        """The files entered until the first of the functions ``until`` ran (its own file included)."""
        self.on = False
        assert self.reentries == set(), sorted(self.reentries)
        n = min(self.ends[name] for name in until if name in self.ends)
        return self.order[:n]


@pytest.fixture(scope="module")
def traced(
    shared_backend_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, PathTrace]]:
    trace = PathTrace()
    threading.setprofile(trace)  # the server's thread and its worker threads start after this
    try:
        settings = settings_for(tmp_path_factory.mktemp("path"), [shared_backend_url])
        app = build_app(lambda: started_gateway(settings, progress=False, clock=time.time))
        with serve_in_thread(Marked(app), lifespan="on") as url:
            chat(
                url, ask("Warm up: name one planet.")
            )  # first-request work (imports, warm-ups) is not the path
            yield url, trace
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        sys.setprofile(None)


def documented(title: str) -> list[str]:
    """The files listed under ``title`` in docs/architecture.md (a numbered list of `path` items)."""
    text = DOC.read_text()
    start = text.index(title)
    block = text[start : text.index("\n\n", text.index("\n1.", start))]
    return re.findall(r"^\d+\. `([^`]+)`", block, flags=re.M)


def test_a_miss_walks_forward_to_the_backend_call(traced):
    url, trace = traced
    trace.start()
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    messages = [*ask("Hi")[:1], *earlier, {"role": "user", "content": "How do I reset my password?"}]
    _, headers, _ = chat(url, messages)  # an earlier reply too: canonicalization restores its bytes
    walk = trace.walk(until=("post_json", "open_stream"))  # the backend call
    assert headers["x-cache"] == "miss"
    assert walk == documented("The path of a miss")
    assert len([f for f in walk if f.startswith("gateway/")]) < 16


def test_a_semantic_hit_walks_forward_to_the_stored_answer(traced):
    url, trace = traced
    chat(url, ask("How do I change my email address?"))
    trace.start()
    _, headers, _ = chat(url, ask("How can I change my email address?"))
    walk = trace.walk(until=("_serve_hit",))  # the hit in hand (then recorded and served)
    assert headers["x-cache"] == "semantic-hit", headers
    assert walk == documented("The path of a semantic hit")
    assert len([f for f in walk if f.startswith("gateway/")]) < 16
