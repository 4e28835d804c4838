"""Attention with the scores soft-capped (Gemma 2): ``cap * tanh(score / cap)`` before the softmax.

torch's fused ``scaled_dot_product_attention`` has no such step, so a capped layer spells attention
out: two matmuls around scale, cap, mask and a float32 softmax, as transformers' eager Gemma 2 does.
It costs the [heads, queries, keys] score matrix in memory that the fused call avoids, which is why
only capped layers take this path (``attend``). The Triton kernels, cachegw's CPU decode kernel and
attention sinks cannot cap: the runner keeps a capped model off them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, cap: float
) -> torch.Tensor:
    """q [B, H, Lq, D] against k, v [B, KVH, Lk, D] (GQA: H a multiple of KVH); ``mask`` True where a
    key is seen, broadcastable to [B, H, Lq, Lk], None for all. Returns [B, H, Lq, D]."""
    b, heads, lq, d = q.shape
    kv_heads = k.shape[1]
    # a KV group's query heads side by side: no repeated K/V
    grouped = q.reshape(b, kv_heads, heads // kv_heads * lq, d)
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.view(b, kv_heads, heads // kv_heads, lq, -1)
    if mask is not None:
        seen = mask.expand(b, heads, lq, mask.shape[-1]).reshape(scores.shape)
        scores = scores.masked_fill(~seen, float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(b, kv_heads, heads // kv_heads * lq, -1)
    return torch.matmul(probs, v).view(b, heads, lq, d)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    is_causal: bool = False,
) -> torch.Tensor:
    """torch's fused attention, or the capped one where the layer caps its scores."""
    if softcap is None:
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
    if is_causal:
        n = q.shape[2]
        mask = torch.ones(n, k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - n)
    return capped_attention(q, k, v, mask, scale, softcap)
