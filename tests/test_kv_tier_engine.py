"""The KV tier inside the real engine, on the tiny random Llama (``testkit/random_llama.TINY``: 2
layers, loads in well under a second) rather than SmolLM2: what is tested is that K/V leave the pool
and come back bit for bit, across an engine restart and between two engines sharing a directory."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cachegw.backend import LLM, SamplingParams
from cachegw.backend.core.sequence import Sequence
from cachegw.backend.entrypoints.metrics import ServerMetrics
from testkit.random_llama import TINY_BLOCK, tiny_greedy, tiny_llm

BS = TINY_BLOCK
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(10, 60))  # 6 full blocks + 2 tokens
OTHER = list(range(100, 150))


def engine(model_dir: str, **tier: Any) -> LLM:
    """A pool of 8 blocks: two 50-token prompts cannot both stay in it."""
    return tiny_llm(model_dir, 64, **tier)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[int]:
    """The prompt's greedy continuation computed from scratch, with no tier."""
    return tiny_greedy(tiny_llama, 64, PROMPT, GREEDY)


def pool_kv(llm: LLM, block_ids: list[int]) -> list[torch.Tensor]:
    return [llm.engine.runner.read_block(b) for b in block_ids]


def prefix_blocks(llm: LLM) -> list[int]:
    """The pool blocks holding PROMPT's full blocks (loading them from a tier if need be)."""
    return llm.engine.block_manager.find_cached_prefix(Sequence("probe", PROMPT, SamplingParams()))


def test_an_evicted_prefix_comes_back_from_ram_with_the_same_output(tiny_llama, reference):
    llm = engine(tiny_llama, kv_offload_bytes=1 << 20)
    llm.generate(PROMPT, GREEDY)
    before = pool_kv(llm, prefix_blocks(llm))
    llm.generate(OTHER, GREEDY)  # evicts the prompt's blocks into RAM
    out = llm.generate(PROMPT, GREEDY)[0]
    assert out.num_cached_tokens == 48 and out.outputs[0].token_ids == reference
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits_by_tier["ram"] > 0
    assert all(torch.equal(a, b) for a, b in zip(before, pool_kv(llm, prefix_blocks(llm)), strict=True))


def test_restart_and_a_second_engine_reuse_the_prefix_from_disk(tiny_llama, reference, tmp_path):
    tier = dict(kv_offload_bytes=0, kv_offload_dir=str(tmp_path))
    first = engine(tiny_llama, **tier)
    first.generate(PROMPT, GREEDY)
    written = pool_kv(first, prefix_blocks(first))
    first.engine.close()  # shutdown: the pool's blocks go to disk
    restarted = engine(tiny_llama, **tier)
    out = restarted.generate(PROMPT, GREEDY)[0]
    assert out.num_cached_tokens == 48 and out.outputs[0].token_ids == reference
    assert restarted.engine.stats().prefix_cache_hits_by_tier["disk"] == 48
    loaded = pool_kv(restarted, prefix_blocks(restarted))
    assert all(torch.equal(a, b) for a, b in zip(written, loaded, strict=True))
    # The other way: a block the restarted engine evicts is found by the first one, still running.
    restarted.generate(OTHER, GREEDY)
    restarted.generate([list(range(150, 200)), list(range(200, 250))], GREEDY)  # OTHER leaves the pool
    restarted.engine.kv_tier.flush()
    again = first.generate(OTHER, GREEDY)[0]
    assert again.num_cached_tokens > 0 and first.engine.stats().prefix_cache_hits_by_tier["disk"] > 0


def test_an_engine_in_another_process_shares_the_disk_tier(tiny_llama, reference, tmp_path):
    """Two OS processes on one directory: this engine starts first (its scan finds nothing), another
    process computes the prompt and shuts down (its blocks written to disk), and this engine, still
    running, finds them on its next miss, bit-identical output included."""
    import subprocess
    import sys
    import textwrap

    tier = dict(kv_offload_bytes=0, kv_offload_dir=str(tmp_path))
    mine = engine(tiny_llama, **tier)
    code = textwrap.dedent(f"""
        from cachegw.backend import LLM, SamplingParams
        llm = LLM(model={tiny_llama!r}, dtype="float32", device="cpu", block_size={BS}, kv_cache_tokens=64,
                  kv_offload_bytes=0, kv_offload_dir={str(tmp_path)!r})
        llm.generate({PROMPT!r}, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        llm.engine.close()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    out = mine.generate(PROMPT, GREEDY)[0]
    assert out.num_cached_tokens == 48 and out.outputs[0].token_ids == reference
    assert mine.engine.stats().prefix_cache_hits_by_tier["disk"] == 48


def test_a_corrupted_file_is_recomputed_not_loaded(tiny_llama, reference, tmp_path):
    tier = dict(kv_offload_bytes=0, kv_offload_dir=str(tmp_path))
    first = engine(tiny_llama, **tier)
    first.generate(PROMPT, GREEDY)
    first.engine.close()
    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) == 6
    for f in files:  # every block's file damaged: torn, or one flipped byte
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0xFF
        f.write_bytes(bytes(raw[:-7]) if f == files[0] else bytes(raw))
    restarted = engine(tiny_llama, **tier)
    out = restarted.generate(PROMPT, GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference
    assert restarted.engine.kv_tier.disk.rejected == 1  # the walk stops at the first bad block


def test_tenants_do_not_share_tiered_blocks(tiny_llama, tmp_path):
    tier = dict(kv_offload_bytes=1 << 20, kv_offload_dir=str(tmp_path))
    first = engine(tiny_llama, **tier)
    first.generate(PROMPT, GREEDY, cache_salt="tenant-a")
    first.engine.close()
    restarted = engine(tiny_llama, **tier)
    assert restarted.generate(PROMPT, GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert restarted.generate(PROMPT, GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 48


def test_metrics_show_hits_bytes_blocks_per_tier_and_load_latency(tiny_llama):
    llm = engine(tiny_llama, kv_offload_bytes=1 << 20)
    llm.generate(PROMPT, GREEDY)
    llm.generate(OTHER, GREEDY)
    llm.generate(PROMPT, GREEDY)
    text = ServerMetrics(llm.engine.stats).render()[0].decode()
    # OTHER took 5 of the prompt's 6 blocks (deepest first); the root block stayed in the pool
    assert 'cachegw:prefix_cache_hits_total{tier="ram"} 40.0' in text
    assert 'cachegw:prefix_cache_hits_total{tier="pool"} 8.0' in text
    assert 'cachegw:kv_tier_blocks{tier="ram"}' in text and 'cachegw:kv_tier_bytes{tier="disk"} 0.0' in text
    assert 'cachegw:kv_tier_load_seconds_count{tier="ram"} 5.0' in text


def test_usage_cached_tokens_count_the_disk_tier_through_the_server(tiny_llama, tmp_path):
    """The engine's HTTP server with the real openai SDK: a shutdown (AsyncEngine.shutdown) writes the pool
    to disk, and after a restart usage.prompt_tokens_details.cached_tokens counts the disk tier's tokens."""
    import openai

    from cachegw.backend.config import load_engine_config
    from cachegw.backend.core.async_engine import AsyncEngine
    from cachegw.backend.core.engine import LLMEngine
    from cachegw.backend.entrypoints.server import build_app
    from testkit.servers import serve_in_thread

    cfg = load_engine_config(
        None, model=tiny_llama, device="cpu", dtype="float32", block_size=BS, kv_cache_tokens=64,
        kv_offload_bytes=1 << 20, kv_offload_dir=str(tmp_path),
    )  # fmt: skip
    cached = []
    for _ in range(2):  # first start, then a restart on the same directory
        engine = AsyncEngine(LLMEngine(cfg))
        with serve_in_thread(build_app(engine, "tiny", 1 << 20)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
            out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
        engine.shutdown()
    assert cached == [0, 48]
