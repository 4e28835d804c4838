"""Soft-capped attention (Gemma 2): the engine's unfused path against transformers' own eager Gemma 2
attention, and the compiled decode step's attention against the eager engine's, both capped."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cachegw.backend.executor.layers.attention import (
    AttentionMetadata,
    DecodeMetadata,
    decode_attention_torch,
    paged_attention_torch,
)
from cachegw.backend.executor.layers.softcap import attend


def test_capped_attention_matches_transformers_gemma2() -> None:
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 9, 16, generator=g) * 3
    k, v = torch.randn(2, 1, 2, 9, 16, generator=g)
    seen = torch.ones(9, 9, dtype=torch.bool).tril()
    module = SimpleNamespace(num_key_value_groups=3, training=False, head_dim=16)
    additive = torch.zeros(9, 9).masked_fill(~seen, float("-inf"))
    expected, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25, softcap=5.0)
    got = attend(q, k, v, None, 0.25, 5.0, is_causal=True)
    torch.testing.assert_close(got.transpose(1, 2), expected, rtol=1e-5, atol=1e-5)
    uncapped = attend(q, k, v, None, 0.25, None, is_causal=True)
    assert not torch.allclose(uncapped, got, atol=1e-3)  # the cap matters at these scores


def test_compiled_decode_attention_caps_as_the_eager_path() -> None:
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, 12, 4, 2, 16, generator=g) * 2  # 12 blocks of 4, 2 KV heads
    lens = [13, 6, 16]
    tables = torch.arange(12, dtype=torch.int32).view(3, 4)
    q = torch.randn(3, 4, 16, generator=g) * 2
    for window in (None, 5):
        decode = DecodeMetadata(
            torch.zeros(3, dtype=torch.long), tables, torch.tensor(lens, dtype=torch.int32)
        )
        compiled = decode_attention_torch(q, k_cache, v_cache, decode, 0.3, window, 4.0)
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(3, dtype=torch.long),
            query_start_loc=torch.arange(4, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=tables,
            max_query_len=1,
            max_seq_len=16,
            num_decodes=3,
            query_lens_cpu=[1, 1, 1],
            seq_lens_cpu=lens,
        )
        eager = paged_attention_torch(q, k_cache, v_cache, meta, 0.3, window=window, softcap=4.0)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
