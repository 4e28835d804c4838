"""StreamingLLM attention: a few sink tokens plus a sliding window, past the model's context.

A query at position ``p`` sees the first ``sinks`` positions and the last ``window`` ones. The
window keys keep their true relative distances (rotary depends on ``p - k`` only), which stay below
the window. StreamingLLM places the sinks just before the window, as if the tokens between had never
been: sink ``i`` then sits ``span - 1 - i`` positions before the query (``span = sinks + window``).
The cache holds keys rotated at their true positions, so instead of moving the sinks this scores
them against the query rotated at ``min(p, span - 1)`` (``q_sink``): the same angle, since
``q(a)·k(b)`` depends on ``a - b`` alone. Before ``p`` reaches ``span`` it is plain causal attention.

Torch only, one sequence at a time, scores in float32: an opt-in mode for conversations longer
than the context, not the fast path.
"""

from __future__ import annotations

import torch

from cachegw.backend.executor.layers.attention import AttentionMetadata, read_blocks


def sink_attention(
    q: torch.Tensor,
    q_sink: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    sinks: int,
) -> torch.Tensor:
    """q and q_sink are [T, H, D] (rotated at true and at capped positions); returns [T, H, D]."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    sink_blocks = -(-sinks // block_size)
    for s, (q_len, ctx) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        lo = starts[s]
        first = max(0, ctx - q_len - window + 1) // block_size  # the window of the first query
        nblocks = -(-ctx // block_size)
        blocks = list(range(min(sink_blocks, first))) + list(range(first, nblocks))
        table = meta.block_tables[s, blocks]
        k_pos = (torch.tensor(blocks)[:, None] * block_size + torch.arange(block_size)).flatten()
        keep = k_pos < ctx
        keys, values = (_per_head(c, table, keep, q.dtype, group) for c in (k_cache, v_cache))
        k_pos = k_pos[keep].to(q.device)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        in_window = (k_pos <= q_pos) & (k_pos > q_pos - window)
        in_sinks = (k_pos < sinks) & (k_pos <= q_pos - window)
        near = q[lo : lo + q_len].float().transpose(0, 1) @ keys.transpose(1, 2)  # [H, q_len, keys]
        far = q_sink[lo : lo + q_len].float().transpose(0, 1) @ keys.transpose(1, 2)
        scores = torch.where(in_window, near, torch.where(in_sinks, far, float("-inf"))) * scale
        out[lo : lo + q_len] = (scores.softmax(-1) @ values).transpose(0, 1).to(q.dtype)
    return out


def _per_head(
    cache: torch.Tensor, table: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype, group: int
) -> torch.Tensor:
    """The kept rows of ``table``'s blocks as float32 [H, keys, D], each KV head repeated for its group."""
    rows = read_blocks(cache, table, dtype).flatten(0, 1)[keep]
    return rows.float().repeat_interleave(group, 1).transpose(0, 1)
