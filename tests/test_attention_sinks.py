"""StreamingLLM attention sinks: the rotary trick against a literal StreamingLLM cache, and the engine
running a sequence past its context in a pool smaller than the sequence.

The reference rebuilds, for each query, the cache StreamingLLM would hold (sinks at positions
0..S-1, the window right after them, the query last) from unrotated keys, and attends over it
densely; ``sink_attention`` must give the same from keys rotated at their true positions.
"""

from __future__ import annotations

import json

import pytest
import torch

from cachegw.backend import LLM, SamplingParams
from cachegw.backend.executor.layers.attention import AttentionMetadata, store_kv_torch
from cachegw.backend.executor.layers.kv_quant import KVCacheFormat
from cachegw.backend.executor.layers.rotary import RotaryEmbedding
from cachegw.backend.executor.layers.sinks import sink_attention
from tests.test_model_families import COMMON

SINKS, WINDOW, BS = 4, 12, 8


def streaming_reference(q_raw, k_raw, v, rotary, q_len: int) -> torch.Tensor:
    """Per query at position p: the literal StreamingLLM cache, rotated at cache positions."""
    ctx, heads = k_raw.shape[0], q_raw.shape[1]
    outs = []
    for j, p in enumerate(range(ctx - q_len, ctx)):
        if p < SINKS + WINDOW:
            kept = list(range(p + 1))
        else:
            kept = list(range(SINKS)) + list(range(p - WINDOW + 1, p + 1))
        where = torch.arange(len(kept))
        k = rotary.rotate(where, k_raw[kept]).double()
        q = rotary.rotate(where[-1:], q_raw[j : j + 1]).double()[0]  # [H, D]
        group = heads // k.shape[1]
        k = k.repeat_interleave(group, 1)
        vv = v[kept].double().repeat_interleave(group, 1)
        w = torch.einsum("hd,khd->hk", q, k).mul(0.125).softmax(-1)
        outs.append(torch.einsum("hk,khd->hd", w, vv))
    return torch.stack(outs)


@pytest.mark.parametrize("kv,tol", [("auto", 1e-5), ("int8", 2e-2)])
def test_sinks_match_a_literal_streaming_cache(kv: str, tol: float):
    """Also with an int8 KV cache (``kv_cache_dtype``): the sinks' reads dequantize."""
    from transformers import LlamaConfig

    rotary = RotaryEmbedding(LlamaConfig(**COMMON, rope_theta=10000.0), 16, 256)
    gen = torch.Generator().manual_seed(0)
    ctx, q_len, heads, kv_heads = 70, 9, 4, 2
    k_raw = torch.randn(ctx, kv_heads, 16, generator=gen)
    v = torch.randn(ctx, kv_heads, 16, generator=gen)
    q_raw = torch.randn(q_len, heads, 16, generator=gen)
    positions = torch.arange(ctx)
    fmt = KVCacheFormat(kv, torch.float32, 16)
    k_cache = torch.zeros(ctx // BS + 1, BS, kv_heads, fmt.row_width, dtype=fmt.storage_dtype)
    v_cache = torch.zeros_like(k_cache)
    store_kv_torch(rotary.rotate(positions, k_raw), v, k_cache, v_cache, positions)
    meta = AttentionMetadata.one_prefill(ctx, BS)
    meta.query_start_loc = torch.tensor([0, q_len], dtype=torch.int32)
    meta.query_lens_cpu, meta.max_query_len = [q_len], q_len
    q_pos = positions[-q_len:]
    out = sink_attention(
        rotary.rotate(q_pos, q_raw), rotary.rotate(q_pos.clamp(max=SINKS + WINDOW - 1), q_raw),
        k_cache, v_cache, meta, 0.125, WINDOW, SINKS,
    )  # fmt: skip
    ref = streaming_reference(q_raw, k_raw, v, rotary, q_len)
    assert (out.double() - ref).abs().max() < tol
    # The sinks' distance matters: scoring them at their true positions gives something else.
    plain = sink_attention(rotary.rotate(q_pos, q_raw), rotary.rotate(q_pos, q_raw), k_cache, v_cache, meta,
                           0.125, WINDOW, SINKS)  # fmt: skip
    assert (plain.double() - ref).abs().max() > 1e-3


def test_engine_runs_past_the_context_with_sinks(tmp_path):
    """A 2-layer random Llama with a 32-token context: 100 tokens run with 4 sinks in a pool of 64
    tokens, and the tokens inside the context equal those of the plain engine."""
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **COMMON})
    )
    kw = dict(model=str(tmp_path), load_format="dummy", dtype="float32", block_size=BS, max_model_len=32)
    prompt = list(range(10, 30))
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True, logprobs=0)
    streaming = LLM(**kw, kv_cache_tokens=64, attention_sinks=SINKS, max_num_batched_tokens=16)
    out = streaming.generate([prompt], params)[0].outputs[0]
    assert len(out.token_ids) == 80
    assert streaming.engine.block_manager.num_free_blocks == 8
    plain = LLM(**kw, kv_cache_tokens=256)
    short = plain.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    )
    ref = short[0].outputs[0]
    assert out.token_ids[:12] == ref.token_ids
    assert abs(out.logprobs[11]["logprob"] - ref.logprobs[11]["logprob"]) < 1e-4
