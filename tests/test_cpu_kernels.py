"""cachegw's own CPU kernels (``backend/executor/layers/cpu_kernels.cpp``), every build this CPU can run
(AVX-512 VNNI, AVX-VNNI, AVX2: an AVX-512 machine runs all three): each weight format against the
float matmul of the same weights, every tile shape of the kernel, bad input refused, the op under
torch.compile, the builds agreeing with each other, and ``[engine] cpu_kernels`` choosing one (or
torch's) or refusing a build the CPU lacks. Skipped where no build loads (the engine then runs torch's)."""

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

STATUS = cpu_kernels.choose("auto")
pytestmark = pytest.mark.skipif(not STATUS.available, reason=f"cachegw's CPU kernels: {STATUS.reason}")
BUILDS = [name for name in cpu_kernels.BUILDS if cpu_kernels.load(name).available]


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


def test_every_build_the_cpu_has_loads() -> None:
    """A build whose instructions this CPU has must compile and load (CI on an AVX-512 machine thus
    tests the AVX2 builds too), and names the instruction set it was compiled for."""
    flags = cpu_kernels._cpu_flags()
    expected = [b.name for b in cpu_kernels.BUILDS.values() if set(b.needs) <= flags]
    assert BUILDS == expected
    for name in BUILDS:
        assert getattr(torch.ops, f"cachegw_{name}").isa() == name


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
def test_gguf_blocks_match_the_dequantized_matmul(kind: str, rows: int, build: str) -> None:
    """The file's blocks go in unchanged (the dequantized layer equals gguf's dequantization); the
    output differs from the float matmul only by rounding the activations to int8 per block of 32.
    50 output rows: 12 tiles of 4 and a remainder of 2; 1-9 activation rows: every column tile."""
    w = np.random.default_rng(0).normal(0, 0.05, (50, 192)).astype(np.float32)
    blocks = decode_blocks(kind, quantize(w, GGMLQuantizationType[kind]))
    layer = BlockLinear.from_blocks(blocks, None, f"cachegw_{build}")
    torch.testing.assert_close(layer.dequantized(), blocks.dequantize(), rtol=0, atol=1e-6)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    y = layer(x)
    assert y.shape == (rows, 50) and y.dtype == torch.float32
    assert _relative_error(y, x @ blocks.dequantize().T) < 0.01


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [32, 77])
def test_prefill_path_matches_the_dequantized_matmul(kind: str, rows: int, build: str) -> None:
    """From 32 activation rows the kernel puts them across the vector lanes (int32 sums per block):
    within 1% of the float matmul, and the same bits as the rows computed one at a time on the
    decode path. 77 rows: a part-filled last tile; 50 output rows: a part-filled last register tile."""
    w = np.random.default_rng(1).normal(0, 0.05, (50, 192)).astype(np.float32)
    blocks = decode_blocks(kind, quantize(w, GGMLQuantizationType[kind]))
    layer = BlockLinear.from_blocks(blocks, None, f"cachegw_{build}")
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    y = layer(x)
    assert _relative_error(y, x @ blocks.dequantize().T) < 0.01
    one_by_one = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(y, one_by_one)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_builds_agree(bits: int) -> None:
    """Every build rounds the activations alike, sums in integers per block and runs the same float
    sequence per output (cpu_kernels.cpp), so they give the same bits (and the engine the same
    tokens): decode and prefill sizes (4 and 300 rows), a K past the tiles' unrolling (576, 9 block
    pairs), 8-bit weights at the top of their range (the AVX2 build's signed path)."""
    w = torch.randn(70, 576) * 0.05
    w[:, :32] = 0.05  # a block whose 8-bit integers are all +127 after absmax rounding
    layer = BlockLinear.from_float(w, None, bits, f"cachegw_{BUILDS[0]}")
    for rows in (4, 300):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        ref = x @ layer.dequantized().T
        outs = {
            b: getattr(torch.ops, f"cachegw_{b}").block_linear(x, layer.w, layer.d, layer.m, bits)
            for b in BUILDS
        }
        for build, y in outs.items():
            assert _relative_error(y, ref) < 0.01, build
            assert torch.equal(y, outs[BUILDS[0]]), build


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("bits", [4, 8])
def test_from_float_with_bias_and_outliers(bits: int, build: str) -> None:
    """Rounded at load (min/max per block for 4 bits, absmax for 8); an activation outlier 300x the
    rest coarsens its own block of 32 (the other 31 round to a step of 300 / 127, as llama.cpp's Q8_0
    activations), so the error grows but stays within a few percent."""
    w = torch.randn(64, 128) * 0.05
    bias = torch.randn(64)
    layer = BlockLinear.from_float(w, bias, bits, f"cachegw_{build}")
    x = torch.randn(3, 128)
    x[:, 5] = 300.0
    ref = x @ layer.dequantized().T + bias
    assert _relative_error(layer(x), ref) < 0.03
    assert _relative_error(layer.dequantized(), w) < (0.1 if bits == 4 else 0.01)
    # batched leading dimensions and bfloat16 inputs come back in their own shape and dtype
    y = layer(x.view(3, 1, 128).to(torch.bfloat16))
    assert y.shape == (3, 1, 64) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("build", BUILDS)
def test_bad_shapes_are_refused_with_a_message(build: str) -> None:
    layer = BlockLinear.from_float(torch.randn(8, 64), None, 4)
    d, m = layer.d[:, :1].contiguous(), layer.m[:, :1].contiguous()
    op = getattr(torch.ops, f"cachegw_{build}").block_linear
    with pytest.raises(RuntimeError, match="multiple of 64"):
        op(torch.randn(1, 32), layer.w, d, m, 4)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        op(torch.randn(1, 64), layer.w, layer.d, layer.m, 5)
    with pytest.raises(RuntimeError, match="weight bytes per row"):
        op(torch.randn(1, 64), layer.w, layer.d, layer.m, 8)
    assert not BlockLinear.supports(96) and BlockLinear.supports(128)


@pytest.mark.parametrize("build", BUILDS)
def test_the_op_compiles_into_a_graph(build: str) -> None:
    """torch.compile traces the op by its registered shape (no graph break) and calls the kernel."""
    layer = BlockLinear.from_float(torch.randn(40, 128) * 0.05, torch.randn(40), 4, f"cachegw_{build}")

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


def test_auto_takes_the_best_build_and_a_build_the_cpu_lacks_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "auto" picks the first build of avx512 > avxvnni > avx2 that loads; a CPU without AVX-512 VNNI
    (most AMD Zen 2/3 and Intel client parts) gets an AVX2 build under "auto", and naming "avx512"
    there stops the engine with what the CPU lacks, before any weight loads."""
    from cachegw.backend.executor.model_runner import ModelRunner

    assert cpu_kernels.choose("auto").build == BUILDS[0]
    assert cpu_kernels.choose(BUILDS[-1]).ops == f"cachegw_{BUILDS[-1]}"
    assert not cpu_kernels.choose("torch").available
    flags = cpu_kernels._cpu_flags() - {"avx512_vnni", "avx_vnni"}
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: flags)
    assert cpu_kernels.choose("auto").build == "avx2"
    with pytest.raises(ValueError, match='cpu_kernels = "avx512" cannot run here: the CPU lacks avx512_vnni'):
        cpu_kernels.choose("avx512")
    cfg = load_engine_config(load_format="dummy", device="cpu", cpu_kernels="avxvnni")
    with pytest.raises(ValueError, match="the CPU lacks avx_vnni"):
        ModelRunner(cfg, None, None, torch.device("cpu"), torch.float32, 64)  # type: ignore[arg-type]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_paged_decode_attention_matches_the_torch_path(window: int | None, build: str, kv: str) -> None:
    """The compiled decode step's attention read straight from the paged cache: the same as the torch
    path's gather, mask and softmax, for grouped heads, a window, a context inside its first block
    and tables padded past the context; every build gives the AVX-512 build's bits. An int8 cache's
    integers and scales are read as stored (the torch path dequantizes them first)."""
    from cachegw.backend.executor.layers import kv_quant
    from cachegw.backend.executor.layers.attention import DecodeMetadata, decode_attention_torch

    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 40, 4, 3, 32, generator=g)  # 40 blocks of 4 tokens, 3 KV heads
    if kv == "int8":
        k_cache, v_cache = (kv_quant.encode(c, torch.int8) for c in (k_cache, v_cache))
    lens = torch.tensor([45, 3, 17], dtype=torch.int32)
    tables = torch.randperm(40, generator=g)[:36].view(3, 12).to(torch.int32).contiguous()
    q = torch.randn(3, 6, 32, generator=g)
    meta = DecodeMetadata(torch.zeros(3, dtype=torch.long), tables, lens)
    ref = decode_attention_torch(q, k_cache, v_cache, meta, 0.2, window)
    op = getattr(torch.ops, f"cachegw_{build}").paged_decode_attention
    got = op(q, k_cache, v_cache, tables, lens, 0.2, window or 0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    first = getattr(torch.ops, f"cachegw_{BUILDS[0]}").paged_decode_attention
    assert torch.equal(got, first(q, k_cache, v_cache, tables, lens, 0.2, window or 0))  # every build alike
    four_heads = q[:, :4].contiguous()
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        op(four_heads, k_cache, v_cache, tables, lens, 0.2, 0)


def test_engine_greedy_tokens_are_the_same_on_every_build() -> None:
    """The embedded Q4_1 model (its int4 blocks, the Q8_0 head) on each build: the same greedy tokens
    for a few prompts, prefill (both kernel paths: 5-9 and 40+ prompt rows) and batched decode
    alike. One engine, eager; its layers are switched from build to build (they share one layout;
    the compiled decode step's attention kernel is compared bit for bit above)."""
    from cachegw.backend import LLM, SamplingParams

    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Water boils at a temperature of " + "very " * 40 + "high",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    options = dict(quantization="int4", dtype="float32", kv_cache_tokens=512, max_num_seqs=4)
    # eager, and every run computes its prompts whole (a cached prefix would change the row counts)
    options.update(compile="off", enable_prefix_caching=False)
    llm = LLM(cpu_kernels=BUILDS[-1], **options)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, BlockLinear)]
    assert layers and all(m.ops == f"cachegw_{BUILDS[-1]}" for m in layers)
    tokens = {}
    for build in BUILDS:
        for m in layers:
            m.ops = f"cachegw_{build}"
        tokens[build] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for build in BUILDS[1:]:
        assert tokens[build] == tokens[BUILDS[0]], build
