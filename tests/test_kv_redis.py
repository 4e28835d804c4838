"""The KV tier shared over Redis (``[engine] kv_offload_url``), against a real ``redis-server`` on a free
port: a prefix one engine computed is served to another from Redis, bit for bit; a corrupted or
foreign value is ignored; Redis down costs misses (logged, counted), never a failed request. A tiny
random Llama (2 layers, token-id prompts) stands in for the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cachegw.backend import LLM, SamplingParams
from cachegw.backend.core.kv_disk import BlockFormat, encode
from cachegw.backend.core.kv_redis import KEY_PREFIX, RedisTier
from testkit.random_llama import TINY_BLOCK, tiny_greedy, tiny_llm
from testkit.servers import free_port, redis_available, redis_server, serve_in_thread

pytestmark = pytest.mark.skipif(not redis_available(), reason="/usr/bin/redis-server is not installed")

BS = TINY_BLOCK
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(10, 90))  # 10 full blocks; 9 reusable (the last token is always computed): 72 tokens


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as url:
        yield url


def engine(model_dir: str, **tier: Any) -> LLM:
    return tiny_llm(model_dir, 256, **tier)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[int]:
    return tiny_greedy(tiny_llama, 256, PROMPT, GREEDY)


def keys(url: str) -> list[bytes]:
    import redis

    with redis.Redis.from_url(url) as r:
        return sorted(r.scan_iter(match=KEY_PREFIX + "*"))


def flush_redis(url: str) -> None:
    import redis

    with redis.Redis.from_url(url) as r:
        r.flushdb()


def test_a_prefix_computed_by_one_engine_is_served_to_another_from_redis(tiny_llama, reference, redis_url):
    flush_redis(redis_url)
    a = engine(tiny_llama, kv_offload_url=redis_url, kv_write_behind=True)
    assert a.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == reference
    a.engine.kv_tier.flush()  # write-behind: the prompt's blocks are in Redis now, A still running
    stored = keys(redis_url)
    assert len(stored) >= len(PROMPT) // BS
    digest = a.engine.kv_tier.fmt.digest
    assert all(k.startswith(f"{KEY_PREFIX}{digest}:".encode()) for k in stored)  # one prefix per model
    b = engine(tiny_llama, kv_offload_url=redis_url)
    out = b.generate(PROMPT, GREEDY)[0]
    assert out.num_cached_tokens == 72 and out.outputs[0].token_ids == reference
    assert b.engine.stats().prefix_cache_hits_by_tier["redis"] == 72
    ttl = _ttl(redis_url, stored[0])
    assert 0 < ttl <= 86400  # bounded: every key expires


def _ttl(url: str, key: bytes) -> int:
    import redis

    with redis.Redis.from_url(url) as r:
        return int(r.ttl(key))


def test_corrupted_and_foreign_values_are_ignored_and_recomputed(tiny_llama, reference, redis_url):
    import redis

    flush_redis(redis_url)
    a = engine(tiny_llama, kv_offload_url=redis_url, kv_write_behind=True)
    a.generate(PROMPT, GREEDY)
    a.engine.kv_tier.flush()
    fmt: BlockFormat = a.engine.kv_tier.fmt
    first = a.engine.block_manager.hashed_by_recency()
    hashes = sorted(h for h, _ in first)
    with redis.Redis.from_url(redis_url) as r:
        victims = [f"{KEY_PREFIX}{fmt.digest}:{h.hex()}" for h in hashes[:2]]
        raw = r.get(victims[0])
        r.set(victims[0], raw[:-100] + bytes(100))  # a flipped payload: the checksum fails
        foreign = BlockFormat("another-model", fmt.dtype, fmt.shape)  # same shape, other identity
        r.set(victims[1], encode(foreign, hashes[1], torch.zeros(fmt.shape, dtype=fmt.dtype)))
    b = engine(tiny_llama, kv_offload_url=redis_url)
    out = b.generate(PROMPT, GREEDY)[0]
    assert out.outputs[0].token_ids == reference  # whatever was found, the bad values were not loaded
    store = b.engine.kv_tier.stores[0]
    assert isinstance(store, RedisTier) and store.rejected >= 1
    assert out.num_cached_tokens < 72  # the walk stops at the first bad block


def test_redis_down_the_engine_keeps_serving_and_counts_it(tiny_llama, reference, tmp_path: Path):
    """A port nothing listens on: every request is answered (200), the misses are counted."""
    import httpx

    from cachegw.backend.config import load_engine_config
    from cachegw.backend.core.async_engine import AsyncEngine
    from cachegw.backend.core.engine import LLMEngine
    from cachegw.backend.entrypoints.server import build_app

    cfg = load_engine_config(
        None, model=tiny_llama, dtype="float32", device="cpu", block_size=BS, kv_cache_tokens=256,
        kv_offload_url=f"redis://127.0.0.1:{free_port()}/0", kv_write_behind=True, compile="off",
    )  # fmt: skip
    engine = AsyncEngine(LLMEngine(cfg))
    try:
        with serve_in_thread(build_app(engine, "tiny", 1 << 20)) as url:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            for _ in range(2):
                r = httpx.post(url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
            metrics = httpx.get(url + "/metrics", timeout=10).text
    finally:
        engine.shutdown()
    counted = [
        line for line in metrics.splitlines() if line.startswith('cachegw:kv_tier_errors_total{tier="redis"}')
    ]
    assert counted and float(counted[0].split()[-1]) >= 1
