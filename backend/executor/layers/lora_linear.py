"""A projection with LoRA deltas beside it: the base layer (float, int8 or int4) runs on the whole
batch once, and the adapters in the step add their low-rank deltas to their own rows.

Every slot's matrices sit in two stacked float32 tensors: ``A`` [in, shards x slots x rank] and,
per output shard, ``B`` [slots x rank, out]. A step with one adapter multiplies only that adapter's
rows by its slot's columns. A step with several multiplies every row by all slots' A at once
(one matmul), zeroes the columns of the slots a row does not run under (the step's mask), and one
matmul per shard with the stacked B sums each row's own delta: a handful of operations per
projection however many adapters the batch mixes, never one adapter per step.
"""

from __future__ import annotations

import torch
from torch import nn


class LoRABatch:
    """This step's adapters, set by the runner before the forward and read by every LoRALinear.

    ``segments``: (slot, rows) of each adapter in the step, empty for the base alone; ``whole``: one
    adapter holds every row; ``masks[k]``: with several adapters, [rows, k x slots x rank] ones where
    a row runs under the slot (k shards side by side)."""

    def __init__(self, slots: int, rank: int) -> None:
        self.slots, self.rank = slots, rank
        self.segments: list[tuple[int, torch.Tensor]] = []
        self.whole = False
        self.masks: dict[int, torch.Tensor] = {}

    def set(self, slot_of_row: list[int], device: torch.device) -> None:
        """``slot_of_row``: each flat row's slot, -1 for the base."""
        rows: dict[int, list[int]] = {}
        for i, slot in enumerate(slot_of_row):
            if slot >= 0:
                rows.setdefault(slot, []).append(i)
        self.segments = [
            (s, torch.tensor(r, dtype=torch.long, device=device)) for s, r in sorted(rows.items())
        ]
        self.whole = len(rows) == 1 and len(next(iter(rows.values()))) == len(slot_of_row)
        self.masks = {}
        if len(rows) > 1:
            slots = torch.tensor(slot_of_row, device=device)
            one_hot = (slots[:, None] == torch.arange(self.slots, device=device)).float()  # [rows, slots]
            for k in (1, 2, 3):
                self.masks[k] = (
                    one_hot[:, None, :, None].expand(-1, k, -1, self.rank).reshape(len(slot_of_row), -1)
                )


class LoRALinear(nn.Module):
    """``base(x)`` plus, for each row under an adapter slot, ``x @ A[slot] @ B[slot]``."""

    def __init__(self, base: nn.Module, in_features: int, shards: list[int], batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.shards, self.slots, self.rank = shards, batch.slots, batch.rank
        self.out_features = sum(shards)
        anchor = next(iter(base.buffers()), None)
        dev = (anchor if anchor is not None else next(base.parameters())).device
        width = self.slots * self.rank
        self.register_buffer("lora_a", torch.zeros(in_features, len(shards) * width, device=dev))
        for i, size in enumerate(shards):
            self.register_buffer(f"lora_b{i}", torch.zeros(width, size, device=dev))

    @property
    def slot_numel(self) -> int:
        """Numbers one slot holds in this layer (its A and every shard's B)."""
        return self.rank * (self._a().shape[0] * len(self.shards) + self.out_features)

    @property
    def device(self) -> torch.device:
        return self._a().device

    def _a(self) -> torch.Tensor:
        a = self.lora_a
        assert isinstance(a, torch.Tensor)
        return a

    def _b(self, shard: int) -> torch.Tensor:
        b = getattr(self, f"lora_b{shard}")
        assert isinstance(b, torch.Tensor)
        return b

    def _cols(self, shard: int, slot: int) -> slice:
        start = (shard * self.slots + slot) * self.rank
        return slice(start, start + self.rank)

    @torch.no_grad()
    def set_slot(self, slot: int, shard: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put one shard's (A [r, in], B [out, r]) into ``slot``, zero-padded to the slot's rank; None
        clears it (the adapter leaves this projection alone)."""
        a_cols, b_rows = (
            self._a()[:, self._cols(shard, slot)],
            self._b(shard)[slot * self.rank : (slot + 1) * self.rank],
        )
        a_cols.zero_()
        b_rows.zero_()
        if pair is not None:
            a, b = pair
            r = a.shape[0]
            a_cols[:, :r] = a.t().to(a_cols.device)
            b_rows[:r] = b.t().to(b_rows.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.batch
        if not batch.segments:
            return y
        flat, out = x.reshape(-1, x.shape[-1]).float(), y.view(-1, self.out_features)
        a, k = self._a(), len(self.shards)
        if len(batch.segments) == 1:  # one adapter: its rows by its slot's columns only
            slot, rows = batch.segments[0]
            xs = flat if batch.whole else flat.index_select(0, rows)
            r = self.rank
            parts = [
                (xs @ a[:, self._cols(i, slot)]) @ self._b(i)[slot * r : (slot + 1) * r] for i in range(k)
            ]
        else:  # several: every slot at once, each row's own slot kept by the mask
            h = (flat @ a) * batch.masks[k]
            width = self.slots * self.rank
            parts = [h[:, i * width : (i + 1) * width] @ self._b(i) for i in range(k)]
        d = (parts[0] if k == 1 else torch.cat(parts, dim=-1)).to(out.dtype)
        if len(batch.segments) == 1 and not batch.whole:
            out.index_add_(0, batch.segments[0][1], d)
        else:
            out += d
        return y
