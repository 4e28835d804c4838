"""The start-up check of the Triton kernels against the torch path, on the model's own head shape.

The engine runs it on CUDA before choosing the Triton path (``ModelRunner._choose_attention_backend``),
so a kernel that does not compile or misbehaves on some GPU falls back to the torch path instead of
serving wrong tokens. The tests run it in Triton's CPU interpreter.
"""

from __future__ import annotations

import torch

from cachegw.backend.executor.layers import kv_quant
from cachegw.backend.executor.layers.attention import AttentionMetadata, paged_attention_torch, store_kv_torch
from cachegw.backend.executor.layers.triton_attention import paged_attention_triton, store_kvcache


def self_check(
    device: torch.device, dtype: torch.dtype, spec, block_size: int, kv_dtype: torch.dtype | None = None
) -> bool:
    """Run the kernels once on a small mixed batch of the model's head shape (and its sliding window,
    if any, capped to fit the batch) and compare with the torch path on the same device. The engine
    calls this at start-up on CUDA and falls back to the torch path if it fails, so a kernel that
    does not compile or misbehaves on some GPU cannot serve wrong tokens. ``kv_dtype``: the cache's
    storage (fp8 for ``kv_cache_dtype = "fp8"``), the compute dtype by default."""
    kv_dtype = kv_dtype or dtype
    gen = torch.Generator(device="cpu").manual_seed(0)
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    query_lens, seq_lens = [1, 1, 20], [5, 40, 37]  # two decodes, then a prefill over a cached prefix
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables, at = [], 0
    for n in seq_lens:
        k = -(-n // block_size)
        tables.append(perm[at : at + k].tolist())
        at += k
    width = max(len(t) for t in tables)
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache, v_cache = (_cache(torch.randn(*shape, generator=gen), device, kv_dtype) for _ in range(2))
    slots = [
        t[p // block_size] * block_size + p % block_size
        for t, q, n in zip(tables, query_lens, seq_lens, strict=True)
        for p in range(n - q, n)
    ]
    total = sum(query_lens)
    q = torch.randn(total, heads, dim, generator=gen).to(device, dtype)
    new_k = torch.randn(total, kv_heads, dim, generator=gen).to(device, dtype)
    new_v = torch.randn(total, kv_heads, dim, generator=gen).to(device, dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    padded = [t + [0] * (width - len(t)) for t in tables]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), num_decodes=2,
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
    )  # fmt: skip
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_torch(new_k, new_v, ref_k, ref_v, meta.slot_mapping)
    store_kvcache(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    ok = all(
        _same_rows(got, ref, dim, exact=kv_dtype == dtype)
        for got, ref in ((k_cache, ref_k), (v_cache, ref_v))
    )
    windows = {None} | {min(w, 24) for w in getattr(spec, "sliding_windows", ()) if w}
    for window in windows:
        if kv_dtype == torch.int8:  # the torch path reads an int8 cache itself (values times scales)
            expected = paged_attention_torch(q.float(), ref_k, ref_v, meta, dim**-0.5, window=window)
        else:
            expected = paged_attention_torch(
                q.float(), ref_k.float(), ref_v.float(), meta, dim**-0.5, window=window
            )
        got = paged_attention_triton(q, k_cache, v_cache, meta, dim**-0.5, window=window).float()
        ok = ok and torch.allclose(got, expected, atol=tol, rtol=tol)
    return bool(ok)


def _cache(values: torch.Tensor, device: torch.device, kv_dtype: torch.dtype) -> torch.Tensor:
    """A cache of ``values`` in the storage ``kv_dtype`` laid out as the engine's pool on ``device``
    (int8 rows carry their scales, and start ``kv_quant.row_align`` bytes apart)."""
    if kv_dtype != torch.int8:
        return values.to(device, kv_dtype)
    rows = kv_quant.encode(values, torch.int8)
    fmt = kv_quant.KVCacheFormat("int8", values.dtype, values.shape[-1], kv_quant.row_align("int8", device))
    cache = fmt.allocate(tuple(values.shape[:-1]), device)
    return cache.copy_(rows)


def _same_rows(got: torch.Tensor, ref: torch.Tensor, dim: int, exact: bool) -> bool:
    """The kernel's stored rows against the torch path's: equal in the compute dtype; fp8 within a
    rounding step of the two conversions; int8 values within one step and scales equal."""
    if exact:
        return bool(torch.equal(got, ref))
    if got.dtype == torch.int8:
        values = (got[..., :dim].int() - ref[..., :dim].int()).abs().max() <= 1
        return bool(values) and torch.equal(got[..., dim:], ref[..., dim:])
    return torch.allclose(got.float(), ref.float(), atol=2**-9, rtol=0.07)
