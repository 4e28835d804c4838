"""The token embedding read from the tied LM head's blocks: one table in memory, not two.

SmolLM2 (like most small models) ties its embedding to its LM head. A quantized engine runs the head
on the file's own blocks (``BlockLinear``); a separate float embedding for the lookup would be a second
copy of the same 28 million weights (57 MiB in bfloat16 against 17 MiB of Q4_1 blocks). A lookup
touches a few rows per step, so dequantizing just those rows from the head's blocks costs nothing
measurable and gives the file's values exactly (w = d * u + m per block of 32).
"""

from __future__ import annotations

import torch
from torch import nn

from cachegw.backend.executor.layers.quantized_linear import BLOCK, BlockLinear


class BlockEmbedding(nn.Module):
    """``embedding(ids)`` as rows of ``head``'s dequantized weight, in ``dtype``."""

    def __init__(self, head: BlockLinear, dtype: torch.dtype) -> None:
        super().__init__()
        # the head's buffers themselves (shared storage), not registered again: the head owns them
        self._head = [head]  # a list keeps it out of this module's children and state dict
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self._head[0]
        flat = ids.reshape(-1)
        tables = (head.w, head.d, head.m)
        assert all(isinstance(t, torch.Tensor) for t in tables)
        w, d, m = (t[flat] for t in tables)  # type: ignore[index]
        rows, k = flat.shape[0], self.embedding_dim
        if head.bits == 4:  # per pair of blocks, byte j = weight j | weight 32 + j << 4
            pairs = w.view(rows, -1, 1, BLOCK)
            w = torch.cat([pairs & 0x0F, pairs >> 4], dim=2)
        blocks = w.reshape(rows, k // BLOCK, BLOCK).float()
        out = blocks * d.float()[..., None] + m.float()[..., None]
        return out.view(*ids.shape, k).to(self.dtype)
