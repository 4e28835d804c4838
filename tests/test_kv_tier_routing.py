"""``routing = "kv"`` with an engine's KV tier, end to end: real engines (the tiny Llama) behind their HTTP
servers, a real Redis, the real gateway. An engine started on a Redis that another engine filled
announces what it can load; the gateway sends a prompt whose blocks only that tier holds to it, not to
the cold engine the hash prefers, and the cached tokens it expected are the ones the engine reports."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from cachegw.backend import SamplingParams
from cachegw.backend.config import load_engine_config
from cachegw.backend.core.async_engine import AsyncEngine
from cachegw.backend.core.engine import LLMEngine
from cachegw.backend.entrypoints.server import build_app as build_backend_app
from cachegw.gateway.api.app import build_app
from cachegw.gateway.compose import started_gateway
from cachegw.gateway.config import BackendSpec, load_settings
from cachegw.policies.routing import rendezvous, routing_key
from testkit.random_llama import TINY_BLOCK, tiny_llm
from testkit.servers import free_port, redis_available, redis_server, serve_in_thread

pytestmark = pytest.mark.skipif(not redis_available(), reason="/usr/bin/redis-server is not installed")

PROMPT = list(range(10, 58))  # 6 full blocks, computed by a writer engine into Redis


def test_a_prompt_goes_to_the_engine_whose_tier_holds_it(tiny_llama: str, tmp_path: Path) -> None:
    with redis_server() as redis_url, contextlib.ExitStack() as stack:
        writer = tiny_llm(tiny_llama, 64, kv_offload_url=redis_url, kv_write_behind=True)
        writer.generate(PROMPT + [1, 2], SamplingParams(temperature=0.0, max_tokens=1))
        writer.engine.kv_tier.flush()
        writer.engine.close()
        engines = []
        for tier in ({}, {"kv_offload_url": redis_url}):  # a cold engine, and one on the filled Redis
            pub, replay = free_port(), free_port()
            cfg = load_engine_config(
                None, model=tiny_llama, device="cpu", dtype="float32", block_size=TINY_BLOCK,
                kv_cache_tokens=64, compile="off", kv_events_endpoint=f"tcp://*:{pub}",
                kv_events_replay_endpoint=f"tcp://*:{replay}", **tier,
            )  # fmt: skip
            engine = AsyncEngine(LLMEngine(cfg))
            stack.callback(engine.shutdown)
            url = stack.enter_context(serve_in_thread(build_backend_app(engine, "tiny", 1 << 20)))
            engines.append((f"{url}/v1", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"))
        (cold, *_), (tiered, *_) = engines
        urls = [cold, tiered]
        prompt = next(
            p
            for i in range(200)
            if rendezvous(urls, routing_key("completion", {"prompt": (p := [*PROMPT, 100 + i, 7])}))[0]
            == cold
        )
        s = load_settings(
            None, data_dir=str(tmp_path), routing="kv", kv_metrics_interval_s=0.1,
            backends=tuple(BackendSpec(url=u, kv_events=e, kv_events_replay=r) for u, e, r in engines),
        )  # fmt: skip
        s = s.model_copy(update={"tenants": s.tenants.model_copy(update={"prefix_isolation": False})})
        app = build_app(lambda: started_gateway(s, progress=False))
        with serve_in_thread(app, lifespan="on") as gw:
            kv = app.state.parts().backends.kv
            deadline = time.monotonic() + 10
            while kv.tiered_blocks().get(tiered, 0) < 6 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert kv.tiered_blocks()[tiered] >= 6 and kv.indexed_blocks()[tiered] == 0  # Redis, not its pool
            r = httpx.post(
                f"{gw}/v1/completions",
                headers={"authorization": "Bearer tenant-a", "cache-control": "no-cache"},
                json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
            metrics = httpx.get(f"{gw}/metrics", timeout=10).text
            assert f'cachegw_gateway_kv_tier_blocks{{backend="{tiered}"}}' in metrics
    query = "SELECT backend, route, expected_cached_tokens, cached_tokens FROM requests"
    deadline = time.monotonic() + 10
    while True:
        with sqlite3.connect(tmp_path / "cachegw.db") as db:
            got = db.execute(query).fetchall()
        if got or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got == [(tiered, "prefix", 48, 48)]
