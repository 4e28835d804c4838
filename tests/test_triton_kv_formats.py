"""Paged attention over quantized KV caches (int8 rows with their scales, fp8 e4m3): the torch path
and the Triton kernels against the dense float64 reference and against each other.

Shares test_triton_attention.py's cases and its interpreter set-up (importing it first sets
TRITON_INTERPRET where there is no CUDA; its fresh-process test reruns this file too).
"""

from __future__ import annotations

import pytest
import torch

from cachegw.backend.executor.layers import kv_quant
from cachegw.backend.executor.layers.attention import paged_attention_torch, store_kv_torch
from tests.test_triton_attention import (
    BLOCK_SIZE,
    DEVICE,
    HEADS,
    ON_CUDA,
    SCENARIOS,
    TOL,
    WINDOW_SCENARIOS,
    dense_attention,
    make_case,
    max_err,
    needs_triton,
    run_triton,
    ta,
)

# The error attention output may take from a quantized cache (values of unit scale).
KV_TOL = {"int8": 2e-2, "fp8": 1.5e-1}


@pytest.mark.parametrize("kv", list(KV_TOL))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_torch_path_quantized_cache(scenario: str, kv: str) -> None:
    """int8/fp8 caches through the torch path's store and reads stay near the dense float64 answer,
    and differ from it where a cached prefix was read (not only the step's own K/V)."""
    case = make_case(*SCENARIOS[scenario], HEADS["gqa3"], garbage=3.0, kv=kv)
    store_kv_torch(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, 0.125, case.key, case.value)
    err = max_err(out.double().cpu(), dense_attention(case, 0.125))
    assert err < KV_TOL[kv]
    if scenario != "prefill":  # a prefill with nothing cached attends to its own unquantized K/V
        assert err > 1e-6


@pytest.mark.parametrize("window", [16])
def test_torch_path_quantized_cache_window(window: int) -> None:
    case = make_case(*WINDOW_SCENARIOS["grouped_decode"], HEADS["gqa3"], garbage=3.0, kv="int8")
    store_kv_torch(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    args = (case.q, case.k_cache, case.v_cache, case.meta, 0.125)
    out = paged_attention_torch(*args, case.key, case.value, window=window).double().cpu()
    assert max_err(out, dense_attention(case, 0.125, window)) < KV_TOL["int8"]


# Triton's CPU interpreter converts to float8 inexactly (values off by a binade), so these run natively only.
fp8_native = pytest.mark.skipif(not ON_CUDA, reason="the interpreter's float8 conversion is inexact")


@needs_triton
@fp8_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scenario", ["decode", "prefix", "mixed", "long_decode"])
def test_triton_fp8_cache(scenario: str, dtype: torch.dtype) -> None:
    """The kernels store into an fp8 (e4m3) cache and read it back: the torch path's answer on the
    same cache, and near the dense one."""
    case = make_case(*SCENARIOS[scenario], HEADS["gqa3"], dtype=dtype, kv="fp8")  # unused slots: NaN
    out = run_triton(case, 0.125)
    assert case.k_cache.dtype == torch.float8_e4m3fn
    assert max_err(out, dense_attention(case, 0.125)) < KV_TOL["fp8"]
    finite = make_case(*SCENARIOS[scenario], HEADS["gqa3"], dtype=dtype, garbage=3.0, kv="fp8")
    store_kv_torch(finite.key, finite.value, finite.k_cache, finite.v_cache, finite.meta.slot_mapping)
    ref = paged_attention_torch(finite.q, finite.k_cache, finite.v_cache, finite.meta, 0.125)
    assert max_err(out, ref.double().cpu()) < TOL[dtype]


@needs_triton
@fp8_native
def test_triton_fp8_store_matches_torch() -> None:
    key = torch.randn(7, 3, 64, device=DEVICE) * 100  # some values past e4m3's 448: saturated
    slots = torch.tensor([5, 17, 63, 0, 40, 22, 9], device=DEVICE)
    caches = [torch.zeros(4, BLOCK_SIZE, 3, 64, device=DEVICE).to(torch.float8_e4m3fn) for _ in range(4)]
    ta.store_kvcache(key, key, caches[0], caches[1], slots)
    store_kv_torch(key, key, caches[2], caches[3], slots)
    assert torch.isfinite(caches[0].float()).all()
    torch.testing.assert_close(caches[0].float(), caches[2].float(), rtol=0.07, atol=2**-9)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scenario", ["decode", "prefix", "mixed", "long_decode"])
@pytest.mark.parametrize("align", [1, 16], ids=["packed", "aligned"])
def test_triton_int8_cache(scenario: str, dtype: torch.dtype, align: int) -> None:
    """The kernels store into an int8 cache (values and each row's scale) and read it back: the torch
    path's answer on the same rows, and near the dense one; rows packed or 16 bytes apart (CUDA's)."""
    case = make_case(*SCENARIOS[scenario], HEADS["gqa3"], dtype=dtype, kv="int8", align=align)
    out = run_triton(case, 0.125)
    assert case.k_cache.dtype == torch.int8 and case.k_cache.shape[-1] == 64 + kv_quant.SCALE_BYTES
    # (a prefill reads its own quantized rows here, the torch path its unquantized ones: a little more error)
    assert max_err(out, dense_attention(case, 0.125)) < 1.5 * KV_TOL["int8"]
    ref = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, 0.125)  # the kernel's rows
    assert max_err(out, ref.double().cpu()) < TOL[dtype]


@needs_triton
def test_triton_int8_store_matches_torch() -> None:
    """Rows the kernel quantizes equal kv_quant.encode's: values within one step, scales bit for bit."""
    key = (
        torch.randn(7, 3, 64, device=DEVICE) * torch.tensor([0.01, 1.0, 300.0], device=DEVICE)[None, :, None]
    )
    key[0, 0, :2] = torch.tensor([0.5, -0.5])  # exact halves of a step: round half to even
    slots = torch.tensor([5, 17, 63, 0, 40, 22, 9], device=DEVICE)
    caches = [torch.zeros(4, BLOCK_SIZE, 3, 66, dtype=torch.int8, device=DEVICE) for _ in range(4)]
    ta.store_kvcache(key, key, caches[0], caches[1], slots)
    store_kv_torch(key, key, caches[2], caches[3], slots)
    assert (caches[0][..., :64].int() - caches[2][..., :64].int()).abs().max() <= 1
    assert torch.equal(caches[0][..., 64:], caches[2][..., 64:])
    assert torch.equal(caches[0], caches[1])
