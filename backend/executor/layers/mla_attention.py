"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged cache of latents.

What a token leaves in the cache is one row of ``kv_lora_rank + qk_rope_head_dim`` values, shared by
every head: the normalized compressed latent ``c`` and the decoupled rotary key ``k_pe`` (already
rotated). Per-head keys and values are ``kv_b_proj(c)`` split into ``k_nope`` and ``v``; each head's
key is ``[k_nope, k_pe]``. The cache is ``[num_blocks, block_size, 1, kv_lora_rank + rope]``: one
part per layer where MHA/GQA have two (K and V), one "head", so block tables, prefix hashes, forks and
the RAM/disk tiers move it as they move any other block.

Two ways to attend, one result (up to rounding):

- expanded: up-project the context's latents into per-head K and V, then ordinary attention. Prefill
  chunks take it (the chunk's many queries share the up-projection);
- absorbed (decodes, ``MLAttention.absorb``): ``q_nope . (W_UK c) = (W_UK^T q_nope) . c``, so each
  head's query is moved into latent space once and scored against the cached latents directly; the
  weighted sum of latents goes through ``W_UV`` after attention. A step then reads the context's
  latents once and never builds per-head K/V: per token and head, ``kv_lora_rank + rope`` multiply-
  adds for scores and ``kv_lora_rank`` for the sum, against up-projecting every cached token each step.
  ``bench/mla_decode.py`` measures both.

Torch only (every device): the Triton kernels and cachegw's CPU decode kernel read per-head K/V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cachegw.backend.executor.layers.attention import (
    DecodeMetadata,
    PagedAttention,
    StepMetadata,
    read_blocks,
)


class MLAttention(PagedAttention):
    """The latent cache of one layer (``k_cache``; ``v_cache`` stays empty) and attention over it.

    A PagedAttention so that what the runner and the embedding forward do to every attention layer
    (assign caches, copy the module with its own scratch cache) applies unchanged."""

    absorb = True  # decodes in the absorbed form (False: up-project the context every step)

    def __init__(
        self, num_heads: int, kv_lora_rank: int, nope_dim: int, rope_dim: int, v_dim: int, scale: float
    ):
        super().__init__(num_heads, 1, kv_lora_rank + rope_dim, scale)
        self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim = kv_lora_rank, nope_dim, rope_dim, v_dim

    def forward(  # type: ignore[override]  # MLA's inputs are not per-head K/V
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        meta: StepMetadata,
        kv_b: torch.Tensor,
    ) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), latent [T, L] (normalized), k_pe [T, rope]
        (rotated), ``kv_b`` the up-projection's weight [H * (nope + v), L]; returns [T, H, v]."""
        rows = torch.cat((latent, k_pe), dim=-1)
        width = rows.shape[-1]
        self.k_cache.view(-1, width).index_copy_(0, meta.slot_mapping, rows.to(self.k_cache.dtype))
        w = kv_b.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        if isinstance(meta, DecodeMetadata):  # the compiled decode step: one padded group
            return self._decode(q_nope, q_pe, meta.block_tables, meta.seq_lens, w)
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        bs = self.k_cache.shape[1]
        for lo, hi in meta.groups():
            blocks = -(-max(meta.seq_lens_cpu[lo:hi]) // bs)
            tables = meta.block_tables[lo:hi, :blocks]
            out[lo:hi] = self._decode(q_nope[lo:hi], q_pe[lo:hi], tables, meta.seq_lens[lo:hi], w)
        nd = meta.num_decodes
        starts = meta.query_start_loc.tolist() if len(meta.query_lens_cpu) > nd else []
        for s in range(nd, len(meta.query_lens_cpu)):
            q_len, ctx, lo = meta.query_lens_cpu[s], meta.seq_lens_cpu[s], starts[s]
            if ctx == q_len:  # nothing cached before this chunk: its own rows
                context = rows[lo : lo + q_len]
            else:
                table = meta.block_tables[s, : -(-ctx // bs)]
                context = read_blocks(self.k_cache, table, q_nope.dtype).view(-1, width)[:ctx]
            out[lo : lo + q_len] = self._expanded(q_nope[lo : lo + q_len], q_pe[lo : lo + q_len], context, w)
        return out

    def _split(self, context: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [..., H, n, nope + rope] and values [..., H, n, v] of rows [..., n, L + rope]."""
        latent, k_pe = context.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = torch.matmul(latent, w.reshape(-1, self.kv_lora_rank).t())
        kv = kv.view(*latent.shape[:-1], self.num_heads, w.shape[1])
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        keys = torch.cat((k_nope, k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope_dim)), dim=-1)
        return keys.transpose(-3, -2), v.transpose(-3, -2)

    def _expanded(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, context: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        """A chunk of queries (the last ``len(q)`` positions of ``context``), causal, expanded form."""
        q_len, ctx = q_nope.shape[0], context.shape[0]
        keys, values = self._split(context, w)
        queries = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [H, q_len, nope + rope]
        mask = None
        if ctx > q_len:
            q_pos = torch.arange(ctx - q_len, ctx, device=q_nope.device)
            mask = torch.arange(ctx, device=q_nope.device)[None, :] <= q_pos[:, None]
        res = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, is_causal=mask is None, scale=self.scale
        )
        return res.transpose(0, 1)

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        w: torch.Tensor,
    ) -> torch.Tensor:
        """One query per sequence over its blocks (``tables`` [n, blocks], padded), tensor ops alone."""
        n = q_nope.shape[0]
        length = tables.shape[1] * self.k_cache.shape[1]
        rows = read_blocks(self.k_cache, tables.reshape(-1), q_nope.dtype).view(
            n, length, self.k_cache.shape[-1]
        )
        seen = (torch.arange(length, device=rows.device)[None, :] < seq_lens[:, None])[
            :, None, :
        ]  # [n, 1, S]
        if not self.absorb:
            keys, values = self._split(rows, w)  # [n, H, S, nope + rope], [n, H, S, v]
            queries = torch.cat((q_nope, q_pe), dim=-1)[:, :, None, :]
            scores = torch.matmul(queries, keys.transpose(-1, -2)).squeeze(2) * self.scale
            probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
            return torch.matmul(probs[:, :, None, :], values).squeeze(2)
        latent, k_pe = rows.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        w_uk, w_uv = w.split([self.nope_dim, self.v_dim], dim=1)  # [H, nope, L], [H, v, L]
        q_latent = torch.einsum("nhd,hdl->nhl", q_nope, w_uk)
        scores = torch.matmul(q_latent, latent.transpose(1, 2)) + torch.matmul(q_pe, k_pe.transpose(1, 2))
        probs = (scores * self.scale).masked_fill(~seen, float("-inf")).softmax(-1)  # [n, H, S]
        return torch.einsum("nhl,hvl->nhv", torch.matmul(probs, latent), w_uv)
