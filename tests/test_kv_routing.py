"""``routing = "kv"`` with real engines: two built-in engines publishing KV events, the real gateway in front.

A request goes where its prompt's blocks are (not where the hash would send it), a saturated engine is
passed over for its idle neighbour, another tenant's request never counts blocks it may not reuse, and
events lost on a dropped connection come back by replay. Small pools, short prompts, one module.
"""

from __future__ import annotations

import contextlib
import gc
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachegw.backend.config import load_engine_config
from cachegw.backend.core.async_engine import AsyncEngine
from cachegw.backend.core.engine import LLMEngine
from cachegw.backend.entrypoints.server import build_app as build_backend_app
from cachegw.gateway.api.app import build_app
from cachegw.gateway.compose import started_gateway
from cachegw.gateway.config import BackendSpec, Settings, load_settings
from cachegw.policies.routing import rendezvous, routing_key
from testkit.servers import free_port, serve_in_thread

MODEL = "SmolLM2-135M-Instruct"
# a system prompt long enough that the blocks it fills (about 10) dwarf the rest of a short request
SYSTEM = {
    "role": "system",
    "content": "You are the help desk of a small public library. Answer briefly and politely. "
    "Opening hours are nine to five on weekdays and ten to two on Saturdays; members may borrow up to "
    "eight books for three weeks, renew twice online, and reserve new titles from the catalogue. "
    "Lost cards are replaced at the front desk for a small fee; children under twelve borrow free of "
    "charge with a parent's card. The reading room is quiet: no phone calls, no food, drinks only in "
    "closed bottles. Printing costs ten cents a page in black and white and fifty in colour; the two "
    "public computers may be booked for an hour at a time, and the wireless network needs no password.",
}


@pytest.fixture(scope="module")
def engines() -> Iterator[list[tuple[str, str, str]]]:
    """Two engines, each behind its HTTP server and publishing its KV events: (url, events, replay)."""
    out, stops = [], contextlib.ExitStack()
    with stops:
        for _ in range(2):
            pub, replay = free_port(), free_port()
            cfg = load_engine_config(
                None, device="cpu", dtype="float32", quantization="none", kv_cache_tokens=2048,
                max_num_seqs=8, kv_events_endpoint=f"tcp://*:{pub}",
                kv_events_replay_endpoint=f"tcp://*:{replay}",
            )  # fmt: skip
            engine = AsyncEngine(LLMEngine(cfg))
            stops.callback(engine.shutdown)
            url = stops.enter_context(serve_in_thread(build_backend_app(engine, MODEL, 1 << 20)))
            out.append((f"{url}/v1", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"))
        yield out
    gc.collect()


def settings(data_dir: Path, engines: list[tuple[str, str, str]], **gateway: Any) -> Settings:
    s = load_settings(
        None,
        data_dir=str(data_dir),
        backends=tuple(BackendSpec(url=u, kv_events=e, kv_events_replay=r) for u, e, r in engines),
        routing="kv",
        kv_metrics_interval_s=0.1,
    )
    return s.model_copy(update={"gateway": s.gateway.model_copy(update=gateway)}) if gateway else s


@contextlib.contextmanager
def gateway(s: Settings) -> Iterator[tuple[str, Any]]:
    """The gateway's URL and its started parts (to reach its KV router)."""
    app = build_app(lambda: started_gateway(s, progress=False))
    with serve_in_thread(app, lifespan="on") as url:
        yield url, app.state.parts()


def ask(url: str, question: str, key: str = "tenant-a", max_tokens: int = 2) -> None:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}", "cache-control": "no-cache"},
        json={"model": MODEL, "messages": [SYSTEM, {"role": "user", "content": question}],
              "temperature": 0, "max_tokens": max_tokens},
        timeout=120,
    )  # fmt: skip
    assert r.status_code == 200, r.text


def hashed_to(urls: list[str], want: str, n: int, template: str) -> list[str]:
    """``n`` questions whose conversations the rendezvous hash sends to ``want``."""
    out = [
        q
        for i in range(200)
        if rendezvous(
            urls,
            routing_key(
                "chat", {"messages": [SYSTEM, {"role": "user", "content": (q := template.format(i))}]}
            ),
        )[0]
        == want
    ]
    assert len(out) >= n
    return out[:n]


def rows(data_dir: Path, n: int) -> list[tuple]:
    """(backend, route, expected cached, cached, prompt tokens) of the logged requests, once there are n."""
    query = (
        "SELECT backend, route, expected_cached_tokens, cached_tokens, prompt_tokens"
        " FROM requests ORDER BY ts"
    )
    deadline = time.monotonic() + 10
    while True:
        with sqlite3.connect(data_dir / "cachegw.db") as db:
            got = db.execute(query).fetchall()
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def settle(parts: Any, url: str, blocks: int) -> None:
    """Until the gateway's index holds ``blocks`` of ``url``'s blocks at least (events are asynchronous)."""
    deadline = time.monotonic() + 10
    while parts.backends.kv.indexed_blocks().get(url, 0) < blocks and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_request_goes_where_its_prefix_is_not_where_the_hash_says(engines, tmp_path: Path) -> None:
    urls = [u for u, _, _ in engines]
    a, b = urls
    first = hashed_to(urls, a, 1, "Can I renew book number {} a third time?")[0]
    later = hashed_to(urls, b, 2, "Is there a fee for a lost card, case {}?")
    with gateway(settings(tmp_path, engines)) as (url, parts):
        ask(url, first)  # nobody holds anything: the hash's choice, a
        settle(parts, a, 8)
        for q in later:  # the hash says b; a holds the system prompt's blocks
            ask(url, q)
        ask(url, later[0], key="tenant-b")  # another tenant: another salt, so nothing it may reuse
        metrics = httpx.get(f"{url}/metrics").text
    got = rows(tmp_path, 4)
    assert got[0][:3] == (a, "hash", 0)
    for backend, route, expected, cached, prompt in got[1:3]:
        assert (backend, route) == (a, "prefix")
        assert expected >= 8 * 16 and cached >= expected  # what the events promised, the engine served
        assert expected < prompt
    assert got[3][2] == 0 and got[3][1] != "prefix"
    assert 'cachegw_gateway_kv_routes_total{reason="prefix"} 2.0' in metrics
    assert "cachegw_gateway_kv_expected_cached_tokens_total" in metrics


def test_a_saturated_engine_is_passed_over_for_its_idle_neighbour(engines, tmp_path: Path) -> None:
    urls = [u for u, _, _ in engines]
    a, b = urls
    questions = hashed_to(urls, a, 3, "Which shelf holds the atlases of region {}?")
    stop = threading.Event()

    def hog(i: int) -> None:  # a long answer streamed straight from a, until told to stop
        story = [{"role": "user", "content": f"Tell a very long story, part {i}."}]
        body = {"model": MODEL, "messages": story, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{a}/chat/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    hogs = [threading.Thread(target=hog, args=(i,)) for i in range(6)]
    with gateway(settings(tmp_path, engines, kv_load_penalty=64.0)) as (url, parts):
        for t in hogs:
            t.start()
        deadline = time.monotonic() + 30
        while parts.backends.kv.load.load.get(a, 0) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert parts.backends.kv.load.load.get(a, 0) >= 4
        try:
            for q in questions:
                ask(url, q)
        finally:
            stop.set()
            for t in hogs:
                t.join(60)
    got = rows(tmp_path, 3)
    assert [r[0] for r in got] == [b] * 3  # the hash said a each time
    assert got[0][1] == "load"  # later ones also find the system prompt's blocks on b: "prefix" or "load"


def test_events_lost_on_a_dropped_connection_are_replayed(engines, tmp_path: Path) -> None:
    urls = [u for u, _, _ in engines]
    a, b = urls
    lost = hashed_to(urls, b, 1, "May I bring my dog, visit {}?")[0]
    later = hashed_to(urls, a, 1, "May I bring my cat, visit {}?")[0]
    s = settings(tmp_path, engines)  # no salts: the requests sent straight to b count for the gateway's
    s = s.model_copy(update={"tenants": s.tenants.model_copy(update={"prefix_isolation": False})})
    with gateway(s) as (url, parts):
        feed = next(f for f in parts.backends.kv.feeds if f.url == b)
        time.sleep(0.3)  # subscribed, caught up
        feed.disconnect()
        before = parts.backends.kv.indexed_blocks()[b]
        httpx.post(  # b stores the system prompt's blocks while the gateway hears nothing
            f"{b}/chat/completions",
            json={"model": MODEL, "messages": [SYSTEM, {"role": "user", "content": lost}], "max_tokens": 1},
            timeout=120,
        ).raise_for_status()
        time.sleep(0.3)
        assert parts.backends.kv.indexed_blocks()[b] == before  # heard nothing
        feed.connect()
        time.sleep(0.3)  # subscribed again (ZeroMQ drops what is sent before a subscription is in place)
        httpx.post(  # anything b publishes now shows the gap; the replay fills it
            f"{b}/completions",
            json={"model": MODEL, "prompt": "Hello there, librarian. " * 12, "max_tokens": 1},  # full blocks
            timeout=120,
        ).raise_for_status()
        settle(parts, b, before + 9)
        assert feed.replays >= 1 and feed.rebuilds == 0
        ask(url, later)  # the hash says a; b holds the prefix, known only through the replay
    assert rows(tmp_path, 1)[0][:2] == (b, "prefix")
