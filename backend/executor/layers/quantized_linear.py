"""Weight-only int8 and int4 linear layers on torch's CPU kernels.

A batch-1 decode step reads every weight once per token, so reading 4 or 8 bits per weight instead
of 32 is most of the speed on CPU. The kernels: ``aten._weight_int8pack_mm`` (int8, one scale per
output channel) and ``aten._weight_int4pack_mm_for_cpu`` (int4 in groups along the input, each with
a scale and a zero: w = (q - 8) * scale + zero). Both are fast only with bfloat16 activations on
this CPU (float32 takes a slow path, ~30x slower), so a layer computes in its ``compute_dtype`` and
returns the input's dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from cachegw.backend.executor.gguf_weights import BLOCK, BlockWeights
from cachegw.backend.executor.layers import cpu_kernels


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias, q int8 [out, in], one scale per output row."""

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, compute_dtype
    ) -> None:
        super().__init__()
        self.compute_dtype = compute_dtype
        self.register_buffer("q", q.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(compute_dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.in_features, self.out_features = q.shape[1], q.shape[0]

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype) -> Int8Linear:
        """Symmetric per-row rounding: scale = max |w| / 127."""
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127)
        return cls(q, scale, bias, compute_dtype)

    def dequantized(self) -> torch.Tensor:
        q, scale = self.q, self.scale
        assert isinstance(q, torch.Tensor) and isinstance(scale, torch.Tensor)
        return q.float() * scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, shape[-1]).to(self.compute_dtype), self.q, self.scale
        )
        y = y.to(x.dtype).view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """Weight-only int4 in groups of ``group_size`` inputs, each with its scale and zero."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None,
        compute_dtype,
        group_size: int = BLOCK,
    ) -> None:
        """``q`` [out, in] in 0..15; ``scale``/``zero`` [out, in / group_size]: w = (q - 8) * scale + zero."""
        super().__init__()
        self.compute_dtype, self.group_size = compute_dtype, group_size
        self.out_features, self.in_features = q.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed)
        # the kernel wants [in / group_size, out, 2]
        sz = torch.stack([scale.float().t(), zero.float().t()], dim=-1).to(compute_dtype).contiguous()
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @staticmethod
    def supports(in_features: int, group_size: int = BLOCK) -> bool:
        return in_features % group_size == 0 and in_features % 2 == 0

    @classmethod
    def from_blocks(cls, blocks: BlockWeights, bias: torch.Tensor | None, compute_dtype) -> Int4Linear:
        """Q4_0/Q4_1 blocks as they are: w = scale * q + offset = (q - 8) * scale + (offset + 8 * scale)."""
        if blocks.kind not in ("Q4_0", "Q4_1"):
            raise ValueError(f"{blocks.kind} blocks are not 4-bit")
        return cls(blocks.q, blocks.scale, blocks.offset + 8 * blocks.scale, bias, compute_dtype)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype, group_size: int = BLOCK
    ) -> Int4Linear:
        """Asymmetric min/max rounding per group (what Q4_1 does)."""
        n, k = weight.shape
        w = weight.detach().float().view(n, k // group_size, group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).view(n, k)
        return cls(q, scale, lo + 8 * scale, bias, compute_dtype, group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(self.compute_dtype),
            self.packed,
            self.group_size,
            self.scales_and_zeros,
        )
        y = y.to(x.dtype).view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class BlockLinear(nn.Module):
    """Blocks of 32 weights along a row, w = d * u + m per block, u 4-bit or 8-bit unsigned, on
    cachegw's kernel (``cpu_kernels.cpp``: AVX-512 VNNI, AVX-VNNI or AVX2), which rounds the
    activations to int8 per block of 32 and multiplies in integers, as llama.cpp does for these
    formats; a row's output has the same bits whatever else shares its step. The GGUF's Q4_0, Q4_1
    and Q8_0 blocks map onto it exactly. Float32 in and out: no casts around the kernel. ``ops``:
    which build's op namespace runs it (``KernelStatus.ops``), the best this CPU has by default;
    every build takes the same layout."""

    def __init__(
        self,
        u: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        bits: int,
        bias: torch.Tensor | None,
        ops: str | None = None,
    ) -> None:
        """``u`` [out, in] unsigned integers (0..15 or 0..255); ``d``/``m`` [out, in / 32]."""
        super().__init__()
        self.bits = bits
        self.ops = ops or cpu_kernels.choose("auto").ops
        self.out_features, self.in_features = u.shape
        self.register_buffer("w", self.pack(u, bits))
        self.register_buffer("d", d.to(torch.float16).contiguous())
        self.register_buffer("m", m.to(torch.float16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @staticmethod
    def pack(u: torch.Tensor, bits: int) -> torch.Tensor:
        """The kernel's layout of ``u`` [out, in]: bytes as they are (8-bit), or per pair of blocks byte
        j = weight j | weight 32 + j << 4 (4-bit)."""
        n, k = u.shape
        u = u.to(torch.uint8)
        if bits == 4:
            pairs = u.view(n, k // 64, 2, BLOCK)
            u = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, k // 2)
        return u.contiguous()

    @staticmethod
    def supports(in_features: int) -> bool:
        return in_features % 64 == 0

    @classmethod
    def from_blocks(
        cls, blocks: BlockWeights, bias: torch.Tensor | None, ops: str | None = None
    ) -> BlockLinear:
        """The file's own integers: Q4_0/Q4_1 as 4-bit (w = scale * q + offset), Q8_0 shifted by 128."""
        return cls(*cls._unsigned(blocks), bias, ops)

    @staticmethod
    def _unsigned(blocks: BlockWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        if blocks.kind == "Q8_0":
            u = blocks.q.view(torch.uint8) ^ 0x80  # q + 128, without a 16-bit copy
            return u, blocks.scale, blocks.offset - 128 * blocks.scale, 8
        return blocks.q, blocks.scale, blocks.offset, 4

    @classmethod
    def from_block_rows(cls, parts: Iterator[BlockWeights], rows: int, ops: str | None = None) -> BlockLinear:
        """Like ``from_blocks`` over consecutive row ranges of one tensor, filled in place: a large
        table (a 49k-row LM head) never exists twice, as integers and as the kernel's bytes."""
        tables: list[torch.Tensor] = []  # w, d, m: allocated from the first range, filled in place
        start, bits = 0, 8
        for part in parts:
            u, d, m, bits = cls._unsigned(part)
            if not tables:
                width = u.shape[1] // 2 if bits == 4 else u.shape[1]
                tables = [torch.empty(rows, width, dtype=torch.uint8)]
                tables += [torch.empty(rows, d.shape[1], dtype=torch.float16) for _ in "dm"]
            end = start + u.shape[0]
            for table, value in zip(tables, (cls.pack(u, bits), d, m), strict=True):
                table[start:end] = value
            start = end
        assert tables and start == rows, f"{start} of {rows} rows"
        w, d, m = tables
        layer = cls(torch.zeros(1, d.shape[1] * BLOCK, dtype=torch.uint8), d[:1], m[:1], bits, None, ops)
        layer.out_features = rows
        layer.w, layer.d, layer.m = w, d, m
        return layer

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, bits: int, ops: str | None = None
    ) -> BlockLinear:
        """4-bit: min/max per block (Q4_1's rounding); 8-bit: absmax/127 per block (Q8_0's)."""
        n, k = weight.shape
        w = weight.detach().float().view(n, k // BLOCK, BLOCK)
        if bits == 4:
            lo, hi = w.amin(dim=-1), w.amax(dim=-1)
            d = ((hi - lo) / 15).clamp(min=1e-12)
            u = torch.round((w - lo[..., None]) / d[..., None]).clamp(0, 15)
            return cls(u.view(n, k), d, lo, 4, bias, ops)
        d = (w.abs().amax(dim=-1) / 127).clamp(min=1e-12)
        q = torch.round(w / d[..., None]).clamp(-127, 127)
        return cls((q + 128).view(n, k), d, -128 * d, 8, bias, ops)

    def dequantized(self) -> torch.Tensor:
        w = self.w
        assert isinstance(w, torch.Tensor)
        if self.bits == 4:
            n = w.shape[0]
            pairs = w.view(n, -1, BLOCK)
            w = torch.stack([pairs & 0x0F, pairs >> 4], dim=2).reshape(n, -1)
        d, m = self.d, self.m
        assert isinstance(d, torch.Tensor) and isinstance(m, torch.Tensor)
        n, k = w.shape
        blocks = w.view(n, k // BLOCK, BLOCK).float()
        return (blocks * d.float()[..., None] + m.float()[..., None]).view(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).float().contiguous()
        y = getattr(torch.ops, self.ops).block_linear(flat, self.w, self.d, self.m, self.bits)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)
