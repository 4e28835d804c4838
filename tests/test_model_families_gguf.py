"""A Qwen3 GGUF (written here by gguf's own writer: llama.cpp's tensor names, Q8_0 projections, a
byte-level BPE tokenizer) loads both ways the engine reads a GGUF: dequantized through transformers
(``quantization = "none"``: exactly transformers' own reading of the file) and straight from the
file's int8 blocks (the default ``auto``: the same tokens, logprobs within int8 activation rounding)."""

from __future__ import annotations

import pytest
import torch

from cachegw.backend import LLM, SamplingParams
from testkit.tiny_gguf import write_tiny_gguf

PROMPT = [5, 17, 99, 3, 250, 7, 7, 8, 100, 101, 44]


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory):
    """(transformers' model read from the GGUF, the file); the engine converts into a scratch cache."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    folder = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CACHEGW_CACHE_DIR", str(folder / "cache"))
        torch.manual_seed(0)
        # head_dim 128 as every Qwen3 has: transformers' GGUF reader assumes it for this architecture
        config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
                             max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.normal_(0, 0.3 if "norm" in name else 0.08)
        path = write_tiny_gguf(model, folder / "tiny-qwen3.gguf")
        reference = AutoModelForCausalLM.from_pretrained(
            str(folder), gguf_file=path.name, dtype=torch.float32
        )
        yield reference.eval(), path


@pytest.mark.parametrize(("mode", "runs", "tolerance"), [("none", "none", 1e-4), ("auto", "int8", 0.02)])
def test_qwen3_gguf_matches_transformers(qwen3_gguf, monkeypatch, mode, runs, tolerance):
    reference, path = qwen3_gguf
    monkeypatch.setenv("CACHEGW_CACHE_DIR", str(path.parent / "cache"))
    llm = LLM(model=str(path), dtype="float32", quantization=mode, kv_cache_tokens=512, compile="off")
    assert llm.engine.runner.quantization == runs
    assert llm.engine.tokenizer.encode("aab", add_special_tokens=False) == [256, 98]  # the file's merges
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    out = llm.generate([PROMPT], params)[0].outputs[0]
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT + out.token_ids])).logits[0, len(PROMPT) - 1 : -1]
    logprobs = logits.float().log_softmax(-1)
    assert out.token_ids == logprobs.argmax(-1).tolist()
    expected = [float(logprobs[i, t]) for i, t in enumerate(out.token_ids)]
    assert [d["logprob"] for d in out.logprobs] == pytest.approx(expected, abs=tolerance)
