"""The fused decode step (executor/fused_decode.py: every layer of a decode-only step in one call into
cachegw's CPU kernels) gives the eager modules' greedy tokens and logprobs exactly, on every kernel build this
CPU runs, for int4 and int8 weights, q/k/v biases (Qwen2) and sliding windows (Mistral, Qwen2); it
stands aside where it cannot run (bfloat16, float weights), and then the eager modules decode. Where
it runs, the eager modules compute what it computes, so both give the same bits.

Tiny random models (2 layers, blocks of 8, prompts past the 16-token window) stand in for real
checkpoints; one test runs the embedded SmolLM2 as the server runs it. Each engine decodes a batch of
prompts of different lengths twice, fused and then with the fused step taken away.
"""

from __future__ import annotations

import pytest
import torch

from cachegw.backend import LLM, SamplingParams
from cachegw.backend.executor.fused_decode import unfused_reason
from cachegw.backend.executor.layers import cpu_kernels
from tests.test_sliding_window import prompt_of, tiny_windowed

STATUS = cpu_kernels.choose("auto")
pytestmark = pytest.mark.skipif(not STATUS.available, reason=f"cachegw's CPU kernels: {STATUS.reason}")
BUILDS = [name for name in cpu_kernels.BUILDS if cpu_kernels.load(name).available]


def _tiny(kind: str, tmp_path) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_windowed(kind), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers:  # peaked attention, so that the window changes the logits
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    hf.save_pretrained(str(tmp_path))
    return str(tmp_path)


def _fused_and_eager(llm: LLM, prompts: list[list[int]], tokens: int) -> None:
    """Greedy decodes with the fused step, then without it: the same tokens, logprobs and top logprobs
    to the bit (the modules run the fused step's arithmetic: ``fused_decode.share_arithmetic``)."""
    runner = llm.engine.runner
    fused = runner.fused
    assert fused is not None, unfused_reason(runner.model, runner.kv_caches[0][0].dtype, STATUS.ops)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=2)
    with_fused = llm.generate(prompts, params)
    assert fused.steps >= tokens - 1  # every step after the prefills was decode-only
    runner.fused = None
    try:
        eager = llm.generate(prompts, params)
    finally:
        runner.fused = fused
    for a, b in zip(with_fused, eager, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize(("kind", "quantization"), [("mistral", "int4"), ("qwen2", "int8")])
def test_fused_decode_gives_the_eager_tokens(tmp_path, build, kind, quantization):
    """Decodes of different lengths in one step, some past the window (Mistral: every layer; Qwen2: the
    second, with q/k/v biases), on each kernel build and weight format."""
    llm = LLM(model=_tiny(kind, tmp_path), dtype="float32", device="cpu", quantization=quantization,
              cpu_kernels=build, kv_cache_tokens=1024, block_size=8, enable_prefix_caching=False,
              compile="off")  # fmt: skip
    assert llm.engine.runner.fused is not None
    assert llm.engine.runner.model.lm_head.ops == f"cachegw_{build}"
    _fused_and_eager(llm, [prompt_of(n, seed=n) for n in (5, 12, 30)], tokens=12)


@pytest.mark.parametrize("build", BUILDS)
def test_fused_decode_with_an_int8_kv_cache_gives_the_eager_tokens(tmp_path, build):
    """An int8 KV cache: the fused step quantizes each new row as kv_quant.encode does (byte for byte)
    and reads the integers with their scales as the modules' row kernel does, so the same bits again;
    and its tokens stay those of a float32 cache for the first steps."""
    options = dict(model=_tiny("mistral", tmp_path), dtype="float32", device="cpu", quantization="int4",
                   cpu_kernels=build, kv_cache_tokens=1024, block_size=8, enable_prefix_caching=False,
                   compile="off")  # fmt: skip
    llm = LLM(kv_cache_dtype="int8", **options)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.int8
    prompts = [prompt_of(n, seed=n) for n in (5, 12, 30)]
    _fused_and_eager(llm, prompts, tokens=12)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    int8 = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm
    floats = [o.outputs[0].token_ids for o in LLM(**options).generate(prompts, params)]
    assert int8 == floats


def test_the_embedded_model_decodes_fused():
    """SmolLM2's Q4_1 file as `cachegw backend` runs it on float32: fused from the first decode, and no
    decode-step compile started (it would buy nothing: the fused step is as fast)."""
    llm = LLM(dtype="float32", quantization="auto", kv_cache_tokens=4096, max_num_seqs=8,
              enable_prefix_caching=False, compile="background")  # fmt: skip
    assert llm.engine.runner.compiled is None
    prompts = [prompt_of(n, seed=n) for n in (7, 40, 90, 160)]
    _fused_and_eager(llm, prompts, tokens=16)


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"dtype": "bfloat16", "quantization": "int4"}, "KV cache is neither float32 nor int8"),
        ({"dtype": "float32", "quantization": "int4", "kv_cache_dtype": "fp8"}, "neither float32 nor int8"),
        ({"dtype": "float32", "quantization": "none"}, "not on cachegw's block-quantized kernels"),
        ({"dtype": "float32", "quantization": "int4", "cpu_kernels": "torch"}, "kernels are not running"),
    ],
)
def test_where_it_cannot_run_the_eager_modules_decode(tmp_path, options, reason):
    llm = LLM(model=_tiny("mistral", tmp_path), device="cpu", kv_cache_tokens=512, block_size=8,
              compile="off", **options)  # fmt: skip
    runner = llm.engine.runner
    assert runner.fused is None
    ops = None if options.get("cpu_kernels") == "torch" else STATUS.ops
    assert reason in (unfused_reason(runner.model, runner.kv_caches[0][0].dtype, ops) or "")
    out = llm.generate(
        [prompt_of(20, seed=1)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 4


def test_dtype_auto_is_float32_where_the_weights_run_on_cachegws_kernels():
    """The fused step needs float32; bfloat16 (AMX CPUs' choice for float weights) would only add casts
    around kernels that take float32. The kernels load in a thread while the caller goes on."""
    from cachegw.backend.config import load_engine_config
    from cachegw.backend.executor.platform import block_weights, cpu_has_amx, resolve_dtype

    cpu, gguf = torch.device("cpu"), object()
    assert block_weights(load_engine_config(None), gguf, cpu)()
    assert block_weights(load_engine_config(None, quantization="int8"), None, cpu)()
    assert not block_weights(load_engine_config(None), None, cpu)()  # a float safetensors model
    assert not block_weights(load_engine_config(None, quantization="none"), gguf, cpu)()
    assert not block_weights(load_engine_config(None, cpu_kernels="torch"), gguf, cpu)()
    assert resolve_dtype("auto", cpu, block_weights=True) == torch.float32
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if cpu_has_amx() else torch.float32)
    assert resolve_dtype("bfloat16", cpu, block_weights=True) == torch.bfloat16


def test_a_failing_fused_step_leaves_the_eager_modules_decoding(tmp_path):
    """A failure in the op (here: a bad call) is logged once; the modules run that step and the rest."""
    llm = LLM(model=_tiny("mistral", tmp_path), dtype="float32", device="cpu", quantization="int4",
              kv_cache_tokens=512, block_size=8, enable_prefix_caching=False, compile="off")  # fmt: skip
    fused = llm.engine.runner.fused
    assert fused is not None
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = prompt_of(20, seed=2)
    fused.ints = fused.ints[:-1]  # one int short: the op refuses it
    out = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert fused.failed is not None and fused.steps == 0
    llm.engine.runner.fused = None
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == out
