"""The KV cache's storage formats (``[engine] kv_cache_dtype``): the compute dtype, int8 or fp8.

``int8``: each (token, KV head) row of K or V is quantized on its own, symmetric, with the scale
``absmax / 127`` kept next to it: the cache's last dim is ``head_dim + 2``, the int8 values then the
scale's two float16 bytes. One scale per token and head, not per channel or per block, because a
token's bytes then depend on that token alone: a block is written once, never rescaled when later
tokens arrive, so prefix-cache hashes, forked partial blocks and the RAM/disk tiers (which copy whole
blocks, scales included) stay valid without anything new. Float16 scales cost 2 bytes a row: SmolLM2's
64-wide rows take 66 bytes against 128 in bfloat16 (1.94x the tokens) and 256 in float32 (3.9x).

``fp8``: float8 e4m3 values, no scale (K/V values are far inside its +-448 range; larger ones
saturate), 1 byte an element. Torch's CPU indexing kernels lack float8, so the torch path moves the
bytes as uint8 and converts on the way in and out.

The torch path reads both back into the compute dtype (``decode``) before attention; cachegw's CPU
decode kernels and the Triton kernels read int8 values as stored and apply each row's scale to its
score and softmax weight. A prefill with nothing cached before it attends to its own unquantized K/V
on the torch path, as vLLM's does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachegw.backend.executor.host_memory import zeros_on_demand

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SCALE_DTYPE = torch.float16
SCALE_BYTES = 2
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


@dataclass(frozen=True)
class KVCacheFormat:
    """How one layer's K (or V) cache stores a [block, token, KV head] row of ``head_dim`` values."""

    kind: str  # auto | int8 | fp8
    compute_dtype: torch.dtype
    head_dim: int
    align: int = 1  # elements: each stored row starts at a multiple of this (``row_align``)

    @property
    def storage_dtype(self) -> torch.dtype:
        return {"int8": torch.int8, "fp8": FP8}.get(self.kind, self.compute_dtype)

    @property
    def row_width(self) -> int:
        """Elements of the cache's last dim: int8 rows carry their scale's bytes after the values."""
        return self.head_dim + SCALE_BYTES if self.kind == "int8" else self.head_dim

    @property
    def stored_width(self) -> int:
        """Elements a row takes in the pool: ``row_width`` rounded up to ``align`` (the rest unused)."""
        return -(-self.row_width // self.align) * self.align

    @property
    def row_bytes(self) -> int:
        return self.stored_width * torch.empty((), dtype=self.storage_dtype).element_size()

    def allocate(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A zeroed cache ``shape + (row_width,)``: a view of rows ``stored_width`` apart."""
        pool = zeros_on_demand(shape + (self.stored_width,), self.storage_dtype, device)
        return pool if self.stored_width == self.row_width else pool[..., : self.row_width]


def row_align(kind: str, device: torch.device) -> int:
    """CUDA: int8 rows (``head_dim + 2`` bytes) start 16 bytes apart, so the Triton kernels load them
    128 bits at a time; at 130 bytes apart every load is a byte, and decode ran at half of bfloat16's
    speed (H200, 64 x 1,024 tokens). The other formats' rows are aligned already; the CPU reads int8
    rows with torch, where the padding would only cost memory."""
    return 16 if kind == "int8" and device.type == "cuda" else 1


def check_supported(kind: str, device: torch.device) -> None:
    """A clear error at start-up when this torch cannot store ``kind`` on ``device``."""
    if kind != "fp8":
        return
    try:
        x = torch.tensor([1.5, 1000.0], device=device)
        ok = decode(encode(x, FP8), FP8, torch.empty_like(x)).tolist() == [1.5, FP8_MAX]
    except (RuntimeError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"kv_cache_dtype='fp8' is not supported by this torch on {device.type}: use int8")


def quantized(cache: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a cache read for compute ``dtype`` needs ``decode`` (it holds int8 or fp8)."""
    return cache.dtype != dtype and cache.dtype in (torch.int8, FP8)


def head_dim(cache: torch.Tensor) -> int:
    """The values per row of a quantized cache (an int8 row ends with its scale's bytes)."""
    return cache.shape[-1] - (SCALE_BYTES if cache.dtype == torch.int8 else 0)


def indexable(cache: torch.Tensor) -> torch.Tensor:
    """The cache as a dtype torch's index ops take on every device (fp8 as its bytes)."""
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


def encode(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """Rows ``[..., head_dim]`` in the cache's storage, as ``indexable`` sees it."""
    if storage == FP8:
        # saturate here: torch's CPU conversion does, its CUDA one turns out-of-range values into NaN
        return x.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    scale = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = scale.div_(127.0).clamp_min_(1e-8)
    d = x.shape[-1]
    out = torch.empty(x.shape[:-1] + (d + SCALE_BYTES,), dtype=torch.int8, device=x.device)
    out[..., :d].copy_(torch.round(x / scale))
    out[..., d:].view(SCALE_DTYPE).copy_(scale)
    return out


def decode(raw: torch.Tensor, storage: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    """Rows read through ``indexable`` back into ``out`` (``[..., head_dim]``, the compute dtype)."""
    if storage == FP8:
        return out.copy_(raw.view(FP8))
    d = out.shape[-1]
    return out.copy_(raw[..., :d]).mul_(raw[..., d:].view(SCALE_DTYPE))
