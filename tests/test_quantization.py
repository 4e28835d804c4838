"""Weight-only int8/int4: GGUF block decoding against gguf's own dequantizer, the quantized layers against
the float matmul of the same weights, the config check, and the real engine on the embedded Q4_1 GGUF
(int4 straight from the file's blocks) answering like float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig

from cachegw.backend.config import load_engine_config
from cachegw.backend.executor.gguf_weights import decode_blocks
from cachegw.backend.executor.layers import cpu_kernels
from cachegw.backend.executor.layers.quantized_linear import BlockLinear, Int4Linear, Int8Linear
from cachegw.backend.executor.model_loader import embedded_gguf_path
from cachegw.backend.executor.model_runner import ModelRunner


def _weights(rows: int = 48, cols: int = 96, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_decoding_matches_gguf_dequantize(kind: str) -> None:
    qtype = GGMLQuantizationType[kind]
    raw = quantize(_weights(), qtype)
    ours = decode_blocks(kind, raw).dequantize().numpy()
    np.testing.assert_allclose(ours, dequantize(raw, qtype), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_int4_from_gguf_blocks_matches_the_dequantized_matmul(kind: str) -> None:
    """The file's 4-bit integers, scales and minimums go into the kernel unchanged: only bfloat16
    rounding of activations and scales separates it from the float matmul of the dequantized file."""
    raw = quantize(_weights(64, 128), GGMLQuantizationType[kind])
    blocks = decode_blocks(kind, raw)
    layer = Int4Linear.from_blocks(blocks, None, torch.bfloat16)
    x = torch.randn(3, 128)
    ref = x @ blocks.dequantize().T
    torch.testing.assert_close(layer(x), ref, rtol=0.02, atol=0.02)
    assert layer(x).dtype == torch.float32


def test_int8_and_int4_from_float_match_the_float_matmul() -> None:
    w = torch.from_numpy(_weights(64, 128))
    bias = torch.randn(64)
    x = torch.randn(5, 128)
    ref = x @ w.T + bias
    i8 = Int8Linear.from_float(w, bias, torch.bfloat16)
    torch.testing.assert_close(i8(x), x @ i8.dequantized().T + bias, rtol=0.02, atol=0.02)
    torch.testing.assert_close(i8(x), ref, rtol=0.05, atol=0.05)
    # int4 at 16 levels a group: the error is a few percent of the output, not of each element
    err = (Int4Linear.from_float(w, bias, torch.bfloat16)(x) - ref).norm() / ref.norm()
    assert err < 0.1


def test_bad_quantization_value_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="quantization is one of auto, none, int8, int4"):
        load_engine_config(quantization="int3")


def _tiny_runner(gguf: Path | None = None, **overrides) -> ModelRunner:
    """A 2-layer random Llama; ``gguf``: the file an engine would name (ignored for random weights)."""
    hf = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )
    cfg = load_engine_config(load_format="dummy", device="cpu", dtype="float32", block_size=4)
    cfg = cfg.with_overrides(kv_cache_tokens=64, **overrides)
    return ModelRunner(cfg, hf, None, torch.device("cpu"), torch.float32, 64, gguf_path=gguf)


@pytest.mark.parametrize("kernels", ["auto", "avx2", "torch"])
def test_runner_quantizes_a_float_checkpoint_at_load(kernels: str) -> None:
    """A tiny random Llama (no GGUF) with quantization=int4: every projection becomes int4, the LM head
    int8, on cachegw's kernels (where this CPU has them) or torch's, and the logits stay close to the
    float runner's on the same weights."""
    if kernels == "avx2" and not cpu_kernels.load("avx2").available:
        pytest.skip("no AVX2 build of cachegw's CPU kernels here")
    native = kernels != "torch" and cpu_kernels.choose("auto").available
    int4, int8 = (BlockLinear, BlockLinear) if native else (Int4Linear, Int8Linear)
    outs = {}
    for mode in ("none", "int4"):
        runner = _tiny_runner(quantization=mode, cpu_kernels=kernels)
        x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
        outs[mode] = runner.model.compute_logits(runner.model.layers[0].mlp(x))
        projections = [runner.model.layers[0].mlp.gate_up_proj, runner.model.layers[1].self_attn.qkv_proj]
        assert all(isinstance(p, int4) for p in projections) == (mode == "int4")
        assert isinstance(runner.model.lm_head, int8) == (mode == "int4")
        if native and mode == "int4":
            assert runner.model.lm_head.bits == 8 and projections[0].bits == 4
            assert kernels == "auto" or projections[0].ops == f"cachegw_{kernels}"
    torch.testing.assert_close(outs["int4"], outs["none"], rtol=0.1, atol=0.05)


def test_auto_is_the_default_and_a_model_without_quantized_tensors_stays_float(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`auto` (the default) over weights with no quantized tensors (random weights here, even with the
    embedded GGUF named as the model, like a float safetensors folder) runs float everywhere, the LM
    head too, and the start-up log says so."""
    assert load_engine_config().quantization == "auto"
    with caplog.at_level("INFO", logger="cachegw.backend"):
        runner = _tiny_runner(embedded_gguf_path())
    assert runner.quantization == "none"
    kinds = {type(m).__name__ for m in runner.model.modules()}
    assert not kinds & {"Int4Linear", "Int8Linear", "BlockLinear"}, kinds
    assert "weights: quantization=auto -> none" in caplog.text


def test_startup_log_names_the_weight_mode_chosen(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="cachegw.backend"):
        runner = _tiny_runner(quantization="int8")
    assert runner.quantization == "int8"
    assert "weights: quantization=int8 -> int8" in caplog.text and "LM head int8" in caplog.text


def test_engine_int4_from_the_gguf_answers_like_float32() -> None:
    """The embedded Q4_1 GGUF loaded as int4 (the file's own blocks) gives float32's greedy answer."""
    from cachegw.backend import LLM, SamplingParams

    llm = LLM(quantization="int4", dtype="float32", kv_cache_tokens=256, max_num_seqs=2)
    assert llm.engine.runner.quantization == "int4"
    kinds = {type(m).__name__ for m in llm.engine.runner.model.layers.modules()}
    assert kinds & {"Int4Linear", "BlockLinear"} and "Linear" not in kinds
    params = SamplingParams(temperature=0.0, max_tokens=9)
    conv = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    text = llm.chat(conv, params)[0].outputs[0].text
    assert text.startswith("The capital of France is Paris")


def test_cachegw_backend_takes_the_weight_mode() -> None:
    from cachegw.gateway.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["backend", "--quantization", "none"]).quantization == "none"
    assert parser.parse_args(["backend"]).quantization is None  # config.toml's value then
    with pytest.raises(SystemExit):
        parser.parse_args(["backend", "--quantization", "int3"])
