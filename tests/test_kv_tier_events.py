"""The KV tier's blocks as KV events: real engines (the tiny Llama) publish what their RAM, disk and Redis
tiers hold under vLLM's ``medium`` field, the gateway's index counts them as loadable (weighed below pool
blocks), and an engine restarted on a shared tier announces what the tier holds, so the index knows
before any request. Each index figure is checked against the ``cached_tokens`` the engine then reports."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from cachegw.backend import LLM, SamplingParams
from cachegw.gateway.upstream.kv_index import CachedPrefix, KvIndex
from cachegw.policies.kv_routing import KvCandidate, choose
from cachegw.protocol.kv_blocks import block_hashes
from cachegw.protocol.kv_events import END_SEQ, BlockRemoved, BlockStored, KVEvent, decode_batch, seq_bytes
from testkit.random_llama import TINY_BLOCK, tiny_llm
from testkit.servers import free_port, redis_available, redis_server

BS = TINY_BLOCK
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(10, 60))  # 6 full blocks + 2 tokens: 48 reusable tokens
OTHER = list(range(100, 150))


class Publishing:
    """A tiny-Llama engine publishing KV events, and what it published so far (read back by replay)."""

    def __init__(self, model: str, tmp: Path, **tier: Any) -> None:
        self.replay = free_port()
        config = tmp / f"events-{self.replay}.toml"
        config.write_text(
            f'[engine]\ncompile = "off"\nkv_events_endpoint = "tcp://*:{free_port()}"\n'
            f'kv_events_replay_endpoint = "tcp://*:{self.replay}"\n'
        )
        self.llm: LLM = tiny_llm(model, 64, config_path=str(config), **tier)

    def events(self) -> list[KVEvent]:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{self.replay}")
        sock.send_multipart((b"", seq_bytes(0)))
        out: list[KVEvent] = []
        try:
            while True:
                assert sock.poll(5000), "the replay socket did not answer"
                _, seq, payload = sock.recv_multipart()
                if seq == END_SEQ:
                    return out
                out += decode_batch(payload).events
        finally:
            sock.close(linger=0)

    def index(self) -> KvIndex:
        index = KvIndex()
        index.apply("e", self.events())
        return index

    def until(self, want: Callable[[KvIndex], bool]) -> KvIndex:
        """The index once ``want`` holds for it (events are published asynchronously)."""
        deadline = time.monotonic() + 10
        while not want(index := self.index()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return index

    def close(self) -> None:
        self.llm.engine.close()


def cached(index: KvIndex) -> CachedPrefix:
    return index.cached("e", PROMPT, None)


def test_blocks_evicted_to_ram_are_published_as_cpu_and_counted_as_loadable(tiny_llama, tmp_path) -> None:
    engine = Publishing(tiny_llama, tmp_path, kv_offload_bytes=1 << 20)
    try:
        engine.llm.generate(PROMPT, GREEDY)
        engine.llm.generate(OTHER, GREEDY)  # evicts 5 of the prompt's 6 blocks (deepest first) into RAM
        index = engine.until(lambda i: cached(i).tier_tokens == 40)
        assert cached(index) == (48, 40)
        hashes = list(block_hashes(PROMPT[:-1], BS, None))
        events = engine.events()
        to_ram = {
            h for e in events if isinstance(e, BlockStored) and e.medium == "CPU" for h in e.block_hashes
        }
        assert set(hashes[1:]) <= to_ram
        ram_stored = next(e for e in events if isinstance(e, BlockStored) and e.medium == "CPU")
        assert ram_stored.token_ids == [] and ram_stored.parent_block_hash is None  # as vLLM's offloading
        out = engine.llm.generate(PROMPT, GREEDY)[0]
        assert out.num_cached_tokens == 48  # what the index promised, 40 of them loaded from RAM
        index = engine.until(lambda i: cached(i).tier_tokens == 0)
        assert cached(index) == (48, 0)  # loaded back: in the pool again, out of RAM
        removed = {h for e in engine.events() if isinstance(e, BlockRemoved) and e.medium == "CPU"
                   for h in e.block_hashes}  # fmt: skip
        assert set(hashes[1:]) <= removed
    finally:
        engine.close()


def test_a_restarted_engine_announces_its_disk_tier(tiny_llama, tmp_path) -> None:
    tier = dict(kv_offload_bytes=0, kv_offload_dir=str(tmp_path / "kv"))
    first = Publishing(tiny_llama, tmp_path, **tier)
    first.llm.generate(PROMPT, GREEDY)
    first.close()  # shutdown: the pool's blocks go to disk
    restarted = Publishing(tiny_llama, tmp_path, **tier)
    try:
        index = restarted.until(lambda i: cached(i).tokens == 48)
        assert cached(index) == (48, 48)  # known before any request: all of it on disk
        assert all(e.medium == "DISK" for e in restarted.events() if isinstance(e, BlockStored))
        out = restarted.llm.generate(PROMPT, GREEDY)[0]
        assert out.num_cached_tokens == 48
        assert restarted.llm.engine.stats().prefix_cache_hits_by_tier["disk"] == 48
        assert cached(restarted.until(lambda i: cached(i).tier_tokens == 0)) == (48, 0)
    finally:
        restarted.close()


@pytest.mark.skipif(not redis_available(), reason="/usr/bin/redis-server is not installed")
def test_an_engine_started_on_a_shared_redis_announces_what_it_can_load(tiny_llama, tmp_path) -> None:
    with redis_server() as url:
        writer = Publishing(tiny_llama, tmp_path, kv_offload_url=url, kv_write_behind=True)
        writer.llm.generate(PROMPT, GREEDY)
        writer.llm.engine.kv_tier.flush()  # write-behind: in Redis now
        written = writer.until(
            lambda i: i.blocks("e").tiered.keys() >= set(block_hashes(PROMPT[:-1], BS, None))
        )
        assert cached(written) == (48, 0)  # in its pool, and in Redis: the pool counts
        assert {m for ms in written.blocks("e").tiered.values() for m in ms} == {"REDIS"}
        writer.close()
        other = Publishing(tiny_llama, tmp_path, kv_offload_url=url)  # a fresh engine on the same Redis
        try:
            index = other.until(lambda i: cached(i).tokens == 48)
            assert cached(index) == (48, 48)
            out = other.llm.generate(PROMPT, GREEDY)[0]
            assert out.num_cached_tokens == 48
            assert other.llm.engine.stats().prefix_cache_hits_by_tier["redis"] == 48
        finally:
            other.close()


def test_vllms_offloaded_blocks_are_translated_and_outlive_their_pool_copy() -> None:
    """vLLM's CPU offloading names its own hashes, with no tokens: the pool event gave their translation."""
    tokens = list(range(1, 10))  # two full blocks of 4 before the last token
    index = KvIndex()
    index.apply("v", [BlockStored([11, 12], None, tokens[:8], 4, None, "GPU")])
    index.apply("v", [BlockStored([11, 12], None, [], 4, None, "CPU"), BlockRemoved([11, 12], "GPU")])
    assert index.cached("v", tokens, None) == (8, 8)
    index.apply("v", [BlockRemoved([12], "CPU")])
    assert index.cached("v", tokens, None) == (4, 4)
    assert 12 not in index.blocks("v").foreign and 11 in index.blocks("v").foreign
    index.apply("v", [BlockStored([99], None, [], 4, None, "CPU")])  # never seen in the pool: unknown
    assert len(index.blocks("v").tiered) == 1


def test_a_tier_hit_counts_less_than_a_pool_hit_and_more_than_none() -> None:
    pool, tier, cold = (
        KvCandidate("p", True, 64, 0),
        KvCandidate("t", True, 64, 0, 64),
        KvCandidate("c", True, 0, 0),
    )
    for order in ([tier, pool, cold], [cold, tier, pool]):
        assert choose(order, 64.0, 0.8).order == ["p", "t", "c"]
    assert choose([cold, tier], 64.0, 0.8).reason == "prefix"
    assert choose([tier, pool], 64.0, 1.0).order == ["t", "p"]  # weight 1: a tie, the hash's order stands
