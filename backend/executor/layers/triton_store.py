"""The Triton kernel that writes a step's new K/V rows into the paged cache, in the cache's format.

The compute dtype is copied; fp8 (e4m3) is converted saturating at +-448; int8 rows are quantized as
``kv_quant.encode`` does (one scale per token and head, ``absmax / 127``, values rounded half to even,
the scale's float16 bytes after the values), so the torch path, the prefix cache and the KV tiers read
rows this kernel wrote exactly as their own.
"""

from __future__ import annotations

import torch

from cachegw.backend.executor.layers.kv_quant import SCALE_BYTES

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path is used instead.
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cb,
        stride_co,
        stride_ch,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        H_PAD: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        FP8: tl.constexpr,
        INT8: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:  # padding token (CUDA-graph batches): nothing to store
            return
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, D_PAD)
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        row = blk * stride_cb + off * stride_co + h * stride_ch
        dst = row[:, None] + d[None, :]
        k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        if FP8:  # e4m3 has no inf: saturate at +-448 as kv_quant.encode does
            k = tl.minimum(tl.maximum(k.to(tl.float32), -448.0), 448.0)
            v = tl.minimum(tl.maximum(v.to(tl.float32), -448.0), 448.0)
        if INT8:
            _store_int8_rows(k_cache_ptr, row, dst, k.to(tl.float32), mask, h < NUM_KV_HEADS, HEAD_DIM)
            _store_int8_rows(v_cache_ptr, row, dst, v.to(tl.float32), mask, h < NUM_KV_HEADS, HEAD_DIM)
        else:
            tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _store_int8_rows(cache_ptr, row, dst, x, mask, row_ok, HEAD_DIM: tl.constexpr):
        """Rows [heads, D] as int8 values with their float16 scale's two bytes (little-endian) after them."""
        scale = tl.maximum(tl.max(tl.where(mask, tl.abs(x), 0.0), 1) / 127.0, 1e-8)
        y = x / scale[:, None]
        r = tl.floor(y + 0.5)  # round half to even, as torch.round
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        r = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)
        tl.store(cache_ptr + dst, r.to(tl.int8), mask=mask)
        bits = scale.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        tl.store(cache_ptr + row + HEAD_DIM, (bits & 0xFF).to(tl.int8), mask=row_ok)
        tl.store(cache_ptr + row + HEAD_DIM + 1, (bits >> 8).to(tl.int8), mask=row_ok)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, KVH, D] into caches [num_blocks, block_size, KVH, row width] in their format
    (the module docstring); slot -1 is skipped."""
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    check_caches(k_cache, v_cache)
    int8 = k_cache.dtype == torch.int8
    if k_cache.shape[-1] != head_dim + (SCALE_BYTES if int8 else 0):
        raise ValueError(f"cache rows of {k_cache.shape[-1]} for a head_dim of {head_dim} ({k_cache.dtype})")
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        FP8=k_cache.dtype == torch.float8_e4m3fn,
        INT8=int8,
    )


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The kernels address both caches with one set of strides and a unit-stride last dim."""
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have equal shapes/strides and a contiguous last dim")
