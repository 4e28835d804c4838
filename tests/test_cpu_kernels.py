"""cachegw's own CPU kernels (``backend/executor/layers/cpu_kernels.cpp``, AVX-512 VNNI): each weight format
against the float matmul of the same weights, every tile shape of the kernel, bad input refused,
the op under torch.compile, and the engine choosing them (or torch's) as ``[engine] cpu_kernels``
says. Skipped where the CPU lacks VNNI or no g++ builds them (the engine then runs torch's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from cachegw.backend.config import load_engine_config
from cachegw.backend.executor.gguf_weights import decode_blocks
from cachegw.backend.executor.layers import cpu_kernels
from cachegw.backend.executor.layers.quantized_linear import BlockLinear

STATUS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(not STATUS.available, reason=f"cachegw's CPU kernels: {STATUS.reason}")


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
def test_gguf_blocks_match_the_dequantized_matmul(kind: str, rows: int) -> None:
    """The file's blocks go in unchanged (the dequantized layer equals gguf's dequantization); the
    output differs from the float matmul only by rounding the activations to int8 in groups of 4.
    50 output rows: 12 tiles of 4 and a remainder of 2; 1-9 activation rows: every column tile."""
    w = np.random.default_rng(0).normal(0, 0.05, (50, 192)).astype(np.float32)
    blocks = decode_blocks(kind, quantize(w, GGMLQuantizationType[kind]))
    layer = BlockLinear.from_blocks(blocks, None)
    torch.testing.assert_close(layer.dequantized(), blocks.dequantize(), rtol=0, atol=1e-6)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    y = layer(x)
    assert y.shape == (rows, 50) and y.dtype == torch.float32
    assert _relative_error(y, x @ blocks.dequantize().T) < 0.01


@pytest.mark.parametrize("bits", [4, 8])
def test_from_float_with_bias_and_outliers(bits: int) -> None:
    """Rounded at load (min/max per block for 4 bits, absmax for 8); an activation outlier 100x the
    rest coarsens only its own group's rounding, so the error stays small."""
    w = torch.randn(64, 128) * 0.05
    bias = torch.randn(64)
    layer = BlockLinear.from_float(w, bias, bits)
    x = torch.randn(3, 128)
    x[:, 5] = 300.0
    ref = x @ layer.dequantized().T + bias
    assert _relative_error(layer(x), ref) < 0.01
    assert _relative_error(layer.dequantized(), w) < (0.1 if bits == 4 else 0.01)
    # batched leading dimensions and bfloat16 inputs come back in their own shape and dtype
    y = layer(x.view(3, 1, 128).to(torch.bfloat16))
    assert y.shape == (3, 1, 64) and y.dtype == torch.bfloat16


def test_bad_shapes_are_refused_with_a_message() -> None:
    layer = BlockLinear.from_float(torch.randn(8, 64), None, 4)
    d, m = layer.d[:, :1].contiguous(), layer.m[:, :1].contiguous()
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.cachegw.block_linear(torch.randn(1, 32), layer.w, d, m, 4)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        torch.ops.cachegw.block_linear(torch.randn(1, 64), layer.w, layer.d, layer.m, 5)
    with pytest.raises(RuntimeError, match="weight bytes per row"):
        torch.ops.cachegw.block_linear(torch.randn(1, 64), layer.w, layer.d, layer.m, 8)
    assert not BlockLinear.supports(96) and BlockLinear.supports(128)


def test_the_op_compiles_into_a_graph() -> None:
    """torch.compile traces the op by its registered shape (no graph break) and calls the kernel."""
    layer = BlockLinear.from_float(torch.randn(40, 128) * 0.05, torch.randn(40), 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(layer(x)) * 2

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch._dynamo.config.patch(disable=False):  # the suite sets TORCH_COMPILE_DISABLE=1
        for rows in (1, 5):
            x = torch.randn(rows, 128)
            torch.testing.assert_close(compiled(x), f(x))


def test_bad_cpu_kernels_value_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="cpu_kernels='fast'"):
        load_engine_config(cpu_kernels="fast")


@pytest.mark.parametrize("window", [None, 20])
def test_paged_decode_attention_matches_the_torch_path(window: int | None) -> None:
    """The compiled decode step's attention read straight from the paged cache: the same as the torch
    path's gather, mask and softmax, for grouped heads, a window, a context inside its first block
    and tables padded past the context."""
    from cachegw.backend.executor.layers.attention import DecodeMetadata, decode_attention_torch

    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 40, 4, 3, 32, generator=g)  # 40 blocks of 4 tokens, 3 KV heads
    lens = torch.tensor([45, 3, 17], dtype=torch.int32)
    tables = torch.randperm(40, generator=g)[:36].view(3, 12).to(torch.int32).contiguous()
    q = torch.randn(3, 6, 32, generator=g)
    meta = DecodeMetadata(torch.zeros(3, dtype=torch.long), tables, lens)
    ref = decode_attention_torch(q, k_cache, v_cache, meta, 0.2, window)
    got = torch.ops.cachegw.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2, window or 0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    four_heads = q[:, :4].contiguous()
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        torch.ops.cachegw.paged_decode_attention(four_heads, k_cache, v_cache, tables, lens, 0.2, 0)
