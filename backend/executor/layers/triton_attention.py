"""Triton kernels for the paged-KV path on CUDA: one unified attention kernel (the cache store is in
``triton_store.py``).

Same contract as ``store_kv_torch`` / ``paged_attention_torch`` in ``attention.py``, for a cache in
the compute dtype, fp8 (read 1 byte a value) or int8 (values and each row's float16 scale). Everything
here launches with grid sizes taken from Python ints (tensor shapes and ``AttentionMetadata``'s
``*_cpu`` / ``max_*`` fields), never from tensor values, so the decode path can be captured in a
CUDA graph.

Attention design: one program per (sequence, block of query tokens, KV head[, KV split]). Its
rows are ``BLOCK_Q`` query tokens x the ``GROUP`` query heads that share the KV head, so each K/V
tile is gathered from the paged cache once per group and fed to a ``tl.dot`` with at least 16
rows even for a single decode token. Softmax is online (flash-attention style) in fp32. For
decode-only batches with few (sequence, KV head) pairs the KV range can be split across programs
(flash-decoding); partial results then go to a workspace and a small kernel merges them. A sliding
window (``WINDOW``, a compile-time constant per layer; 0 = none) starts the KV loop at the window
of the block's first query and masks each row to its own window, so blocks before it are never read.

Triton is imported guarded: the module imports without it. ``TRITON_INTERPRET=1``, set before
triton is first imported (``triton.jit`` reads it when each kernel, triton's own library functions
included, is defined), runs the kernels on CPU tensors for tests.
"""

from __future__ import annotations

import os

import torch

from cachegw.backend.executor.layers.attention import AttentionMetadata
from cachegw.backend.executor.layers.kv_splits import default_splits
from cachegw.backend.executor.layers.triton_store import check_caches, store_kvcache

__all__ = ["paged_attention_triton", "store_kvcache", "triton_available"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path is used instead.
    triton = None
    tl = None

_LOG2E = 1.4426950408889634


def triton_available() -> bool:
    """True when the kernels can run here: triton imports and there is CUDA or the interpreter."""
    if triton is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:

    @triton.jit
    def _attn_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        out_ptr,
        acc_ws_ptr,
        m_ws_ptr,
        l_ws_ptr,
        block_tables_ptr,
        seq_lens_ptr,
        query_start_ptr,
        scale_log2,
        num_heads,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_cb,
        stride_co,
        stride_ch,
        stride_bt,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        IEEE_DOT: tl.constexpr,
        UPCAST: tl.constexpr,
        WINDOW: tl.constexpr,
        KV_FP8: tl.constexpr,
        KV_INT8: tl.constexpr,
    ):
        BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
        seq = tl.program_id(0)
        q_block = tl.program_id(1)
        kv_head = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS

        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        if q_block * BLOCK_Q >= q_len:  # grid is sized for the longest query in the batch
            return
        ctx = tl.load(seq_lens_ptr + seq)

        rows = tl.arange(0, BLOCK_M)
        q_idx = q_block * BLOCK_Q + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
        q_pos = ctx - q_len + q_idx  # absolute position of each row's query token
        tok = (q_start + q_idx).to(tl.int64)
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)

        # Keys this block of queries can see: up to the position of its last query token, and with
        # a window from the window start of its first one.
        kv_end = ctx - q_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
        if WINDOW > 0:
            kv_start = tl.maximum(ctx - q_len + q_block * BLOCK_Q - WINDOW + 1, 0)
        else:
            kv_start = 0
        if NUM_SPLITS == 1:
            lo = kv_start
            hi = kv_end
        else:
            per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, BLOCK_N), NUM_SPLITS) * BLOCK_N
            lo = kv_start + split * per_split
            hi = tl.minimum(kv_end, lo + per_split)

        # A finite floor (not -inf) keeps fully masked tiles and empty splits free of inf - inf.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_off = kv_head * stride_ch
        cols = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            pos = start + cols
            k_ok = pos < hi
            blk = tl.load(table + pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            base = blk * stride_cb + (pos % BLOCK_SIZE) * stride_co + kv_off
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if KV_FP8:  # an fp8 cache: read 1 byte a value, compute in the queries' dtype
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            if KV_INT8:  # int8 values are exact in the queries' dtype: each row's scale multiplies its
                # score and its softmax weight instead of every value (fewer multiplies, no rounding of k * s)
                k_scale = _row_scale(k_cache_ptr, base, k_ok, HEAD_DIM)
                v_scale = _row_scale(v_cache_ptr, base, k_ok, HEAD_DIM)
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if IEEE_DOT:  # fp32 inputs: keep full precision instead of TF32
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            if KV_INT8:
                s = s * k_scale[None, :]
            visible = k_ok[None, :] & (pos[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(visible, s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if KV_INT8:
                p = p * v_scale[None, :]
            if IEEE_DOT:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & d_ok[None, :],
            )
        else:
            ws_row = (tok * num_heads + head) * NUM_SPLITS + split
            tl.store(m_ws_ptr + ws_row, m_i, mask=row_ok)
            tl.store(l_ws_ptr + ws_row, l_i, mask=row_ok)
            tl.store(acc_ws_ptr + ws_row[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def _row_scale(cache_ptr, base, ok, HEAD_DIM: tl.constexpr):
        """Each int8 row's scale: the float16 whose two bytes follow its values (rows and head dims are
        even, so it is one aligned 2-byte load)."""
        scales = (cache_ptr + base + HEAD_DIM).to(tl.pointer_type(tl.float16))
        return tl.load(scales, mask=ok, other=0.0).to(tl.float32)

    @triton.jit
    def _merge_splits_kernel(
        out_ptr,
        acc_ws_ptr,
        m_ws_ptr,
        l_ws_ptr,
        num_heads,
        stride_ot,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        row = (tok * num_heads + head) * NUM_SPLITS
        sp = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, D_PAD)
        m = tl.load(m_ws_ptr + row + sp)
        weight = tl.exp2(m - tl.max(m, 0))
        denom = tl.sum(weight * tl.load(l_ws_ptr + row + sp), 0)
        acc = tl.load(acc_ws_ptr + (row + sp)[:, None] * D_PAD + d[None, :])
        out = tl.sum(weight[:, None] * acc, 0) / tl.where(denom > 0, denom, 1.0)
        tl.store(
            out_ptr + tok * stride_ot + head * stride_oh + d,
            out.to(out_ptr.dtype.element_ty),
            mask=d < HEAD_DIM,
        )


# Whether triton.jit built interpreter kernels (TRITON_INTERPRET=1 when this module was imported).
_INTERPRETED = triton is not None and type(_attn_kernel).__name__ == "InterpretedFunction"


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention for every query token of the step; q is [T, H, D], returns [T, H, D].

    ``num_splits`` fixes the number of KV splits (a power of two); by default it is chosen only for
    decode-only batches. ``window``: each query sees its last ``window`` positions only. Rows of
    padding tokens past ``query_start_loc[-1]`` are left unwritten, as in the torch path.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = len(meta.query_lens_cpu)
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    check_caches(k_cache, v_cache)
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    # Rows = query tokens x heads of a group; tl.dot wants >= 16 of them, and register pressure caps them.
    cap = 64 if d_pad <= 128 else 32
    block_m = max(group_pad, min(cap, max(16, triton.next_power_of_2(meta.max_query_len * group_pad))))
    block_n = 64 if d_pad <= 64 else 32
    if num_splits is None:
        num_splits = default_splits(meta, num_seqs * kv_heads, block_n, q.device, window)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if num_splits > 1:
        acc_ws = torch.empty(num_tokens, num_heads, num_splits, d_pad, dtype=torch.float32, device=q.device)
        m_ws = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        l_ws = torch.empty_like(m_ws)
    else:
        acc_ws = m_ws = l_ws = out  # unused by the kernel when not splitting
    # The CPU interpreter runs tl.dot on bf16 bit patterns as integers, so it gets fp32 operands instead.
    upcast = _INTERPRETED and q.dtype == torch.bfloat16
    grid = (num_seqs, triton.cdiv(meta.max_query_len, block_m // group_pad), kv_heads * num_splits)
    _attn_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        acc_ws,
        m_ws,
        l_ws,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale * _LOG2E,
        num_heads,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        IEEE_DOT=q.dtype == torch.float32 or upcast,
        UPCAST=upcast,
        WINDOW=window or 0,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        KV_INT8=k_cache.dtype == torch.int8,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            acc_ws,
            m_ws,
            l_ws,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=num_splits,
        )
    return out
