"""GGUFs of Qwen3, Gemma 2, Gemma 3 and Phi-3 (written here by gguf's own writer: llama.cpp's tensor names
and Gemma's 1 + w norms, Q8_0 projections, a byte-level BPE tokenizer) load both ways the engine reads
a GGUF: dequantized through transformers (``quantization = "none"``: exactly transformers' own
reading of the file) and with the projections from the file's int8 blocks (the default ``auto``:
logprobs within int8 activation rounding, greedy but for near ties), the float tensors (embeddings,
norms) then straight from the file too (``model_weights.py``), Gemma's norms back from llama.cpp's
1 + w."""

from __future__ import annotations

import pytest
import torch

from cachegw.backend import LLM, SamplingParams
from testkit.tiny_gguf import write_tiny_gguf

PROMPT = list(range(30, 70))  # longer than Gemma's window of 16
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)  # fmt: skip


def tiny_config(arch: str):
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config, Qwen3Config

    if arch == "phi3":  # fused qkv_proj and gate_up_proj, as llama.cpp's attn_qkv and ffn_up hold them
        return Phi3Config(**SHAPE, num_hidden_layers=2, pad_token_id=0, tie_word_embeddings=False)
    if arch == "qwen3":  # head_dim 128 as every Qwen3 has: transformers' GGUF reader assumes it
        return Qwen3Config(**SHAPE, num_hidden_layers=2, head_dim=128, tie_word_embeddings=False)
    # the soft-caps, query scale and local rope base stay the defaults, which the GGUF reader assumes
    config = Gemma2Config if arch == "gemma2" else Gemma3TextConfig
    return config(**SHAPE, num_hidden_layers=6, head_dim=32, sliding_window=16)


@pytest.fixture(scope="module", params=["qwen3", "gemma2", "gemma3", "phi3"])
def gguf_model(request, tmp_path_factory):
    """(transformers' model read from the GGUF, the file); the engine converts into a scratch cache."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(request.param), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if "norm" in name else 0.08)
    path = write_tiny_gguf(model, folder / f"tiny-{request.param}.gguf", request.param)
    reference = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=path.name, dtype=torch.float32)
    return reference.eval(), path


@pytest.mark.parametrize(("mode", "runs", "tolerance"), [("none", "none", 1e-4), ("auto", "int8", 0.05)])
def test_gguf_matches_transformers(gguf_model, monkeypatch, mode, runs, tolerance):
    reference, path = gguf_model
    monkeypatch.setenv("CACHEGW_CACHE_DIR", str(path.parent / "cache"))
    llm = LLM(model=str(path), dtype="float32", quantization=mode, kv_cache_tokens=512, compile="off")
    assert llm.engine.runner.quantization == runs
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, torch.nn.Linear)]
    assert (not linears) == (mode == "auto")  # auto: every projection and the head from the blocks
    assert llm.engine.tokenizer.encode("aab", add_special_tokens=False) == [256, 98]  # the file's merges
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    out = llm.generate([PROMPT], params)[0].outputs[0]
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT + out.token_ids])).logits[0, len(PROMPT) - 1 : -1]
    logprobs = logits.float().log_softmax(-1)
    expected = [float(logprobs[i, t]) for i, t in enumerate(out.token_ids)]
    assert [d["logprob"] for d in out.logprobs] == pytest.approx(expected, abs=tolerance)
    best = logprobs.max(-1).values.tolist()
    if mode == "none":
        assert out.token_ids == logprobs.argmax(-1).tolist()
    else:  # int8 activations may flip a near tie, never pick a clearly worse token
        assert all(e >= b - tolerance for e, b in zip(expected, best, strict=True))
