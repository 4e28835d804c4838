"""Other members of the Llama family load from a HF folder and match transformers token for token.

Tiny random models (2 layers) written with transformers' own save_pretrained stand in for real
checkpoints: Qwen2 (q/k/v bias), Mistral, Llama 3 (scaled rope), and a dummy-weight load.
"""

from __future__ import annotations

import json

import pytest
import torch

from cachegw.backend import LLM, SamplingParams

COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip


def tiny_config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if kind == "qwen2":
        return Qwen2Config(**COMMON, rope_theta=10000.0)
    if kind == "mistral":
        return MistralConfig(**COMMON, rope_theta=10000.0, sliding_window=None)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    return LlamaConfig(**{**COMMON, "tie_word_embeddings": True}, rope_parameters=rope)


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "llama3"])
def test_family_matches_transformers(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32).eval()
    if kind == "qwen2":
        with torch.no_grad():  # make the biases matter
            for layer in hf.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    hf.save_pretrained(str(tmp_path))
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_tokens=1024, block_size=8)
    assert llm.engine.runner.quantization == "none"  # the default "auto" keeps a float checkpoint float
    prompts = [[5, 17, 99, 3, 250, 7, 7, 8, 100, 101, 44], list(range(30, 90))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                              pad_token_id=0)  # fmt: skip
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def test_dummy_weights_need_only_a_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **COMMON})
    )
    llm = LLM(model=str(tmp_path), load_format="dummy", dtype="float32", kv_cache_tokens=512)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].text == ""  # no tokenizer: ids only
    assert llm.engine.tokenizer is None


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(model=str(tmp_path), load_format="dummy", kv_cache_tokens=512)


def test_missing_model_path_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        LLM(model="meta-llama/Llama-3-8B")
