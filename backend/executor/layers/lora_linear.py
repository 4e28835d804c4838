"""A projection with LoRA deltas beside it: the base layer (float, int8 or int4) runs on the whole
batch once, and each adapter slot present in the step adds its low-rank delta to its own rows.

Each slot's matrices sit in stacked tensors, so a step mixing adapters and the base costs one base
matmul plus, per adapter in it, two small float32 matmuls over that adapter's rows (gathered by
index): never one adapter per step. A fused projection (q/k/v, gate/up) keeps its shards' A matrices
side by side, so one matmul makes every shard's rank-r activations, and each shard's B writes its
own columns.
"""

from __future__ import annotations

import torch
from torch import nn


class LoRABatch:
    """This step's rows per adapter slot, set by the runner before the forward and read by every
    LoRALinear; empty when no sequence of the step runs under an adapter (the base alone)."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, torch.Tensor]] = []


class LoRALinear(nn.Module):
    """``base(x)`` plus, for the rows of each slot in ``batch``, ``x @ A[slot] @ B[slot]``."""

    def __init__(
        self, base: nn.Module, in_features: int, shards: list[int], slots: int, rank: int, batch: LoRABatch
    ) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.shards, self.rank = shards, rank
        self.out_features = sum(shards)
        device = next(iter(base.buffers()), None)
        if device is None:
            device = next(base.parameters())
        dev = device.device
        # A of every shard side by side: [slots, in, shards * rank]; B per shard: [slots, rank, out_i]
        self.register_buffer("lora_a", torch.zeros(slots, in_features, len(shards) * rank, device=dev))
        for i, size in enumerate(shards):
            self.register_buffer(f"lora_b{i}", torch.zeros(slots, rank, size, device=dev))

    @property
    def slot_numel(self) -> int:
        """Numbers one slot holds in this layer (its A and every shard's B)."""
        a = self.lora_a
        assert isinstance(a, torch.Tensor)
        return a[0].numel() + self.rank * self.out_features

    @property
    def device(self) -> torch.device:
        a = self.lora_a
        assert isinstance(a, torch.Tensor)
        return a.device

    def _b(self, shard: int) -> torch.Tensor:
        b = getattr(self, f"lora_b{shard}")
        assert isinstance(b, torch.Tensor)
        return b

    @torch.no_grad()
    def set_slot(self, slot: int, shard: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put one shard's (A [r, in], B [out, r]) into ``slot``, zero-padded to the slot's rank; None
        clears it (the adapter leaves this projection alone)."""
        a_all = self.lora_a
        assert isinstance(a_all, torch.Tensor)
        cols = slice(shard * self.rank, (shard + 1) * self.rank)
        a_all[slot, :, cols].zero_()
        self._b(shard)[slot].zero_()
        if pair is not None:
            a, b = pair
            r = a.shape[0]
            a_all[slot, :, shard * self.rank : shard * self.rank + r] = a.t().to(a_all.device)
            self._b(shard)[slot, :r] = b.t().to(a_all.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.batch.segments:
            return y
        flat, out = x.reshape(-1, x.shape[-1]), y.view(-1, self.out_features)
        whole = len(self.batch.segments) == 1 and self.batch.segments[0][1].numel() == flat.shape[0]
        a_all, r = self.lora_a, self.rank
        assert isinstance(a_all, torch.Tensor)
        for slot, rows in self.batch.segments:
            h = (flat if whole else flat.index_select(0, rows)).float() @ a_all[slot]  # [rows, shards * rank]
            if len(self.shards) == 1:
                d = h @ self._b(0)[slot]
            else:
                d = torch.cat(
                    [h[:, i * r : (i + 1) * r] @ self._b(i)[slot] for i in range(len(self.shards))], -1
                )
            if whole:
                out += d.to(out.dtype)
            else:
                out.index_add_(0, rows, d.to(out.dtype))
        return y
