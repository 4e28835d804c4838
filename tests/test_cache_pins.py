"""Pins (``cache_pins``, ``prompt_cache_retention``): a pinned prompt prefix stays in the KV cache
while other prompts flood it, expires on its clock, renews without new references, stays within the
share cap, and bad values get 400. First the pin table on the block manager alone, then the real engine
on SmolLM2 behind its HTTP server with a small KV pool."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cachegw.backend.core.block_manager import BlockManager
from cachegw.backend.core.pins import PinRequest, PinTable
from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.backend.core.scheduler import Scheduler
from cachegw.backend.core.sequence import Sequence


class Clock:
    """An injectable clock: time moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the pin table on the block manager ---------------------------------------------------------

BS = 4


def computed(bm: BlockManager, tokens: list[int], rid: str, pins: tuple[PinRequest, ...] = ()) -> Sequence:
    """A sequence whose whole prompt is allocated, computed and findable."""
    s = Sequence(rid, tokens, SamplingParams(pins=pins))
    cached = bm.find_cached_prefix(s)
    n = s.num_tokens - len(cached) * BS
    bm.allocate(s, cached, n)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)
    return s


def refs(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def test_a_pin_holds_its_blocks_after_the_request_and_releases_them_when_it_expires() -> None:
    bm, clock = BlockManager(16, BS), Clock()
    pins = PinTable(bm, max_blocks=8, clock=clock)
    s = computed(bm, list(range(14)), "a", (PinRequest(10, 30.0),))  # 10 tokens: two whole blocks
    pins.on_computed(s)
    assert s.num_pinned_tokens == 8 and pins.num_pool_blocks == 2
    held = s.block_table[:2]
    bm.free_blocks(s)  # the request ends (or is preempted, or aborted): the pin's references stay
    assert [bm.blocks[b].ref_count for b in held] == [1, 1]
    assert not set(held) & set(bm.free)  # not evictable
    clock.now += 29
    assert pins.expire() == 0
    clock.now += 2
    assert pins.expire() == 2
    assert pins.num_blocks == 0 and refs(bm) == [0] * 16 and len(bm.free) == 16
    assert len(bm.find_cached_prefix(Sequence("b", list(range(14)), SamplingParams()))) == 3  # still cached


def test_pinning_again_renews_without_adding_references() -> None:
    bm, clock = BlockManager(16, BS), Clock()
    pins = PinTable(bm, max_blocks=8, clock=clock)
    pin = (PinRequest(12, 10.0),)
    first = computed(bm, list(range(13)), "a", pin)
    pins.on_computed(first)
    bm.free_blocks(first)
    before = refs(bm)
    clock.now += 8
    again = computed(bm, list(range(13)), "b", pin)
    pins.on_computed(again)
    bm.free_blocks(again)
    assert refs(bm) == before and pins.num_pool_blocks == 3
    clock.now += 5  # past the first pin's expiry, within the renewed one
    assert pins.expire() == 0 and pins.num_pool_blocks == 3
    clock.now += 6
    assert pins.expire() == 3 and refs(bm) == [0] * 16


def test_the_share_cap_refuses_the_blocks_over_it() -> None:
    bm, clock = BlockManager(16, BS), Clock()
    pins = PinTable(bm, max_blocks=3, clock=clock)
    a = computed(bm, list(range(21)), "a", (PinRequest(20, 60.0),))
    pins.on_computed(a)
    assert a.num_pinned_tokens == 3 * BS and pins.num_pool_blocks == 3
    b = computed(bm, [7] * 9, "b", (PinRequest(8, 60.0),))
    pins.on_computed(b)
    assert b.num_pinned_tokens == 0 and pins.num_pool_blocks == 3


def test_a_shorter_pin_inside_a_longer_one_keeps_the_prefix_as_long_as_the_longer() -> None:
    bm, clock = BlockManager(16, BS), Clock()
    pins = PinTable(bm, max_blocks=8, clock=clock)
    s = computed(bm, list(range(17)), "a", (PinRequest(4, 100.0), PinRequest(16, 10.0)))
    pins.on_computed(s)
    assert s.num_pinned_tokens == 16
    clock.now += 11
    assert pins.expire() == 3 and pins.num_pool_blocks == 1  # the first block lives on for 100 s


def test_a_waiting_request_that_cannot_fit_beside_pins_takes_their_blocks_when_nothing_runs() -> None:
    bm, clock = BlockManager(8, BS), Clock()
    pins = PinTable(bm, max_blocks=8, clock=clock)
    s = computed(bm, list(range(25)), "a", (PinRequest(24, 600.0),))
    pins.on_computed(s)
    bm.free_blocks(s)
    assert pins.num_pool_blocks == 6
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, pins=pins)
    big = Sequence("big", [99] * 30, SamplingParams())  # 8 blocks: the whole pool
    sched.add(big)
    batch = sched.schedule()
    assert batch.seqs == [big] and pins.num_pool_blocks == 0 and pins.released_early == 6


def test_a_spill_pin_holds_no_pool_block_when_a_tier_exists() -> None:
    import torch

    from cachegw.backend.core.kv_disk import BlockFormat
    from cachegw.backend.core.kv_tier import KVOffload

    fmt = BlockFormat("test", torch.float32, (2,))
    tier = KVOffload(fmt, lambda b: torch.full((2,), float(b)), lambda b, d: None, ram_bytes=1 << 10)
    bm, clock = BlockManager(8, BS, tier=tier), Clock()
    pins = PinTable(bm, max_blocks=8, clock=clock)
    s = computed(bm, list(range(13)), "a", (PinRequest(12, 86400.0, spill=True),))
    pins.on_computed(s)
    bm.free_blocks(s)
    assert s.num_pinned_tokens == 12 and pins.num_tier_blocks == 3 and pins.num_pool_blocks == 0
    assert refs(bm) == [0] * 8  # evictable: an eviction moves them to the tier
    upgraded = computed(bm, list(range(13)), "b", (PinRequest(8, 60.0),))  # a pool pin over them
    pins.on_computed(upgraded)
    bm.free_blocks(upgraded)
    assert pins.num_pool_blocks == 2 and pins.num_tier_blocks == 1
    clock.now += 86401
    assert pins.expire() == 3 and refs(bm) == [0] * 8


# --- the real engine behind its HTTP server -----------------------------------------------------

POOL_TOKENS = 1024  # 64 blocks of 16: a few of the prefixes below
SHARE = 0.25  # at most 16 blocks pinned


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, str, Clock]]:
    from cachegw.backend.config import load_engine_config
    from cachegw.backend.core.async_engine import AsyncEngine
    from cachegw.backend.core.engine import LLMEngine
    from cachegw.backend.entrypoints.server import build_app
    from testkit.servers import serve_in_thread

    cfg = load_engine_config(
        None, device="cpu", dtype="float32", quantization="auto", kv_cache_tokens=POOL_TOKENS,
        max_num_seqs=4, pinned_kv_share=SHARE, compile="off",
    )  # fmt: skip
    engine = AsyncEngine(LLMEngine(cfg))
    clock = Clock()
    engine.engine.pins.clock = clock
    try:
        with serve_in_thread(build_app(engine, "SmolLM2-135M-Instruct", 1 << 20)) as url:
            yield engine, url, clock
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def system_prompt(topic: str, sentences: int = 12) -> str:
    return " ".join(
        f"Rule {i} about {topic}: answer briefly and stay on the subject of {topic}."
        for i in range(sentences)
    )


def chat(url: str, system: str, user: str, salt: str, **extra: Any) -> httpx.Response:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 1, "temperature": 0, "cache_salt": salt, **extra,
    }  # fmt: skip
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def details(resp: httpx.Response) -> dict[str, int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]


def clear_pins(url: str, clock: Clock) -> None:
    """Let every pin expire: the next scheduling step releases them."""
    clock.now += 10**7
    chat(url, "Hi.", "Hi.", salt="clear")


def test_a_pinned_prefix_survives_a_flood_that_evicts_an_unpinned_one(served) -> None:
    engine, url, clock = served
    clear_pins(url, clock)
    p, q = system_prompt("astronomy"), system_prompt("geology")
    pin = [{"messages": 1, "ttl": 600}]
    first_p = details(chat(url, p, "What is a star?", "flood", cache_pins=pin))
    first_q = details(chat(url, q, "What is a rock?", "flood"))
    assert first_p["pinned_tokens"] >= 8 * 16 and first_p["pinned_tokens"] % 16 == 0
    assert first_q["pinned_tokens"] == 0
    metrics = httpx.get(f"{url}/metrics").text
    assert f'cachegw:kv_pinned_blocks{{where="pool"}} {first_p["pinned_tokens"] // 16}.0' in metrics
    for i in range(6):  # unrelated prompts: more tokens than the whole pool
        chat(url, system_prompt(f"subject {i} of the flood", 16), f"Question {i}?", f"other-{i}")
    again_p = details(chat(url, p, "What is a planet?", "flood", cache_pins=pin))
    again_q = details(chat(url, q, "What is sand?", "flood"))
    assert again_p["cached_tokens"] >= first_p["pinned_tokens"]
    assert again_q["cached_tokens"] < first_p["pinned_tokens"] // 2


def test_an_expired_pin_frees_its_blocks(served) -> None:
    engine, url, clock = served
    clear_pins(url, clock)
    pins, bm = engine.engine.pins, engine.engine.block_manager
    got = details(
        chat(
            url,
            system_prompt("chemistry"),
            "What is an atom?",
            "expiry",
            cache_pins=[{"messages": 1, "ttl": 5}],
        )
    )
    assert got["pinned_tokens"] > 0
    # Pins are taken in the step before the answer goes out; the stats snapshot may lag one step.
    assert pins.num_pool_blocks == got["pinned_tokens"] // 16
    held = [p.block_id for p in pins.pins.values()]
    assert all(bm.blocks[b].ref_count == 1 for b in held)
    clock.now += 4
    chat(url, "Hi.", "Hello.", "expiry-other")
    assert engine.stats().pinned_blocks["pool"] == pins.num_pool_blocks == len(held)  # not yet
    clock.now += 2
    chat(url, "Hi.", "Hello again.", "expiry-other")
    assert pins.num_pool_blocks == 0 and pins.num_blocks == 0
    assert all(bm.blocks[b].ref_count == 0 and b in bm.free for b in held)  # evictable again


def test_renewal_keeps_one_reference_and_moves_the_expiry(served) -> None:
    engine, url, clock = served
    clear_pins(url, clock)
    pins, bm = engine.engine.pins, engine.engine.block_manager
    system, pin = system_prompt("botany"), [{"messages": 1, "ttl": 60}]
    first = details(chat(url, system, "What is a leaf?", "renew", cache_pins=pin))
    expiries = {h: p.expires_at for h, p in pins.pins.items()}
    clock.now += 30
    second = details(chat(url, system, "What is a root?", "renew", cache_pins=pin))
    assert second["pinned_tokens"] == first["pinned_tokens"]
    assert second["cached_tokens"] >= first["pinned_tokens"]
    assert pins.pins.keys() == expiries.keys()
    assert all(pins.pins[h].expires_at == e + 30 for h, e in expiries.items())
    assert all(bm.blocks[p.block_id].ref_count == 1 for p in pins.pins.values() if p.block_id is not None)


def test_the_share_cap_holds(served) -> None:
    engine, url, clock = served
    clear_pins(url, clock)
    cap = int(SHARE * POOL_TOKENS) // 16
    long_system = system_prompt("zoology", 24)  # more blocks than the cap
    got = details(chat(url, long_system, "What is a cat?", "cap", prompt_cache_retention="in_memory"))
    assert got["pinned_tokens"] == cap * 16
    other = details(
        chat(url, system_prompt("music"), "What is a chord?", "cap", cache_pins=[{"messages": 2, "ttl": 60}])
    )
    assert other["pinned_tokens"] == 0  # the request runs; it is just not pinned
    assert engine.engine.pins.num_pool_blocks == cap


def test_retention_pins_the_whole_prompt_and_streams_report_it(served) -> None:
    engine, url, clock = served
    clear_pins(url, clock)
    body = {
        "messages": [
            {"role": "system", "content": system_prompt("weather", 6)},
            {"role": "user", "content": "Rain?"},
        ],
        "max_tokens": 2, "temperature": 0, "cache_salt": "stream", "stream": True,
        "stream_options": {"include_usage": True}, "prompt_cache_retention": "24h",
    }  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: {")]
    import json

    usage = json.loads(lines[-1][6:])["usage"]
    assert usage["prompt_tokens_details"]["pinned_tokens"] == usage["prompt_tokens"] // 16 * 16 > 0
    # No RAM/disk tier here: "24h" holds pool blocks, for a day.
    assert all(
        p.block_id is not None and p.expires_at == clock.now + 86400 for p in engine.engine.pins.pins.values()
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"cache_pins": {"messages": 1, "ttl": 5}}, "cache_pins"),
        ({"cache_pins": [{"messages": 1, "ttl": 5}] * 5}, "cache_pins"),
        ({"cache_pins": [5]}, "cache_pins[0]"),
        ({"cache_pins": [{"messages": 0, "ttl": 5}]}, "cache_pins[0].messages"),
        ({"cache_pins": [{"messages": 1, "ttl": 5}, {"messages": True, "ttl": 5}]}, "cache_pins[1].messages"),
        ({"cache_pins": [{"messages": 1.5, "ttl": 5}]}, "cache_pins[0].messages"),
        ({"cache_pins": [{"messages": 1, "ttl": 0}]}, "cache_pins[0].ttl"),
        ({"cache_pins": [{"messages": 1, "ttl": -3}]}, "cache_pins[0].ttl"),
        ({"cache_pins": [{"messages": 1, "ttl": "5m"}]}, "cache_pins[0].ttl"),
        ({"cache_pins": [{"messages": 1, "ttl": 10**9}]}, "cache_pins[0].ttl"),
        ({"cache_pins": [{"messages": 1}]}, "cache_pins[0].ttl"),
        ({"cache_pins": [{"messages": 1, "ttl": 5, "type": "ephemeral"}]}, "cache_pins[0].type"),
        ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ],
)
def test_bad_pins_get_400_naming_the_value(served, extra: dict[str, Any], param: str) -> None:
    _, url, _ = served
    resp = chat(url, "Hi.", "Hello.", "bad", **extra)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_null_pins_and_completions_retention_change_nothing(served) -> None:
    _, url, _ = served
    assert details(chat(url, "Hi.", "Hello.", "null", cache_pins=None))["pinned_tokens"] == 0
    body = {"prompt": "Hello", "max_tokens": 1, "prompt_cache_retention": "in_memory"}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens_details"]["pinned_tokens"] == 0


def test_anthropic_cache_control_through_the_gateway_survives_a_flood(served, tmp_path) -> None:
    """End to end: the anthropic SDK's `cache_control` on the system prompt, through the gateway, pins
    the prefix in the engine; after a flood of other prompts it is read from the cache
    (`cache_read_input_tokens`), while the same-size prompt sent without a breakpoint was evicted."""
    anthropic = pytest.importorskip("anthropic")
    from cachegw.gateway.api.app import build_app
    from cachegw.gateway.compose import started_gateway
    from cachegw.gateway.config import load_settings
    from testkit.servers import serve_in_thread

    engine, url, clock = served
    clear_pins(url, clock)
    settings = load_settings(None, data_dir=str(tmp_path), backends=({"url": f"{url}/v1", "pins": True},))
    app = build_app(lambda: started_gateway(settings, progress=False))
    with serve_in_thread(app, lifespan="on") as gw:
        client = anthropic.Anthropic(base_url=gw, api_key="tenant-a", max_retries=0, timeout=120)

        def ask(system: str, question: str, breakpoint: bool) -> Any:
            block: dict[str, Any] = {"type": "text", "text": system}
            if breakpoint:
                block["cache_control"] = {"type": "ephemeral"}
            return client.messages.create(
                model="SmolLM2-135M-Instruct",
                max_tokens=1,
                system=[block],
                messages=[{"role": "user", "content": question}],
            ).usage

        pinned, plain = system_prompt("botany"), system_prompt("zoology")
        first = ask(pinned, "What is a leaf?", True)
        assert first.cache_creation_input_tokens >= 8 * 16  # written under the pin
        ask(plain, "What is a cat?", False)
        for i in range(6):  # unrelated prompts straight to the engine: more than the whole pool
            chat(url, system_prompt(f"topic {i} of the flood", 16), f"Question {i}?", f"flood-{i}")
        again = ask(pinned, "What is a root?", True)
        other = ask(plain, "What is a dog?", False)
        assert again.cache_read_input_tokens >= first.cache_creation_input_tokens
        assert other.cache_read_input_tokens < first.cache_creation_input_tokens // 2
