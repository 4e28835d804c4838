"""Paged attention that also reports how much attention each cached key received.

Heavy-Hitter Oracle eviction (``[engine] kv_eviction = "h2o"``, ``backend/core/h2o.py``) ranks a
sequence's cached tokens by the attention they have accumulated. SDPA and the fused kernels (Triton,
cachegw's CPU decode kernel) never materialise the attention weights, so this path spells attention
out: per sequence, scores in float32, causal over cache slots, softmax, weights times values; and
adds each key's weight, summed over heads and query rows, into ``key_mass[s, slot]``. The runner
sums it over layers. A sequence whose cache was compacted has its keys in slots that no longer equal
their positions, which attention does not need: every cached key precedes the step's queries, and
the keys carry the rotary positions they were written with.
"""

from __future__ import annotations

import torch

from cachegw.backend.executor.layers.attention import AttentionMetadata, read_blocks


def scored_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    key_mass: torch.Tensor,
) -> torch.Tensor:
    """q is [T, H, D]; returns [T, H, D] and adds into ``key_mass`` [S, max context] (float32)."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for s, (q_len, ctx) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        lo = starts[s]
        table = meta.block_tables[s, : -(-ctx // block_size)]
        keys, values = (
            read_blocks(c, table, q.dtype)
            .flatten(0, 1)[:ctx]
            .float()
            .repeat_interleave(group, 1)
            .transpose(0, 1)
            for c in (k_cache, v_cache)
        )  # [H, ctx, D]
        scores = (q[lo : lo + q_len].float().transpose(0, 1) @ keys.transpose(1, 2)) * scale
        if q_len > 1:
            q_idx = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(ctx, device=q.device) > q_idx, float("-inf"))
        weights = scores.softmax(-1)  # [H, q_len, ctx]
        key_mass[s, :ctx] += weights.sum((0, 1))
        out[lo : lo + q_len] = (weights @ values).transpose(0, 1).to(q.dtype)
    return out
