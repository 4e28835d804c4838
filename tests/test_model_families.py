"""Every supported model family loads from a HF folder and matches transformers token for token.

Tiny random models written with transformers' own save_pretrained stand in for real checkpoints:
Qwen2 (q/k/v bias), Mistral, Llama 3 (scaled rope), a dummy-weight load; Qwen3 (q/k norms),
Gemma 2 (soft-capping, alternating windows), Gemma 3 (q/k norms, rope per layer kind), Phi-3
(fused checkpoint projections), also quantized; and the refusals of what a family cannot run.
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


# Qwen3, Gemma 2/3 and Phi-3: tiny random models (4-6 layers, a window of 16 where the family has
# one) against transformers' own classes, tokens and logprobs. Weights are drawn wider than the
# classes' init (and the norms away from their neutral value), so that every part matters.
NEW = dict(COMMON, num_hidden_layers=4, rms_norm_eps=1e-6)


def new_family_config(kind: str):
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config, Qwen3Config

    if kind == "qwen3":
        return Qwen3Config(**NEW, head_dim=32)
    if kind == "gemma2":
        return Gemma2Config(**NEW, head_dim=16, sliding_window=16, query_pre_attn_scalar=24,
                            attn_logit_softcapping=2.0, final_logit_softcapping=3.0)  # fmt: skip
    if kind == "gemma3":  # 5 local layers, then a global one; each kind its own rope
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}  # fmt: skip
        return Gemma3TextConfig(**{**NEW, "num_hidden_layers": 6}, head_dim=16, sliding_window=16,
                                query_pre_attn_scalar=16, rope_parameters=rope)  # fmt: skip
    return Phi3Config(**NEW, sliding_window=24, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def save_random(kind: str, folder) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # eager, whatever the default of the installed transformers: the attention that caps Gemma 2's scores
    # (with its default, transformers 5.17 on the GPU image parted from us and 5.24 at the second token)
    config = new_family_config(kind)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.3 if "norm" in name else 0.08)
    hf.save_pretrained(str(folder))
    return hf


def reference(hf, prompt: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy choice at each position of prompt + ``tokens`` (one forward pass: equal to
    its own greedy generation wherever ``tokens`` are), and the logprobs of ``tokens``."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    logprobs = logits.log_softmax(-1)
    return logits.argmax(-1).tolist(), [float(logprobs[i, t]) for i, t in enumerate(tokens)]


NEW_PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 8, 100, 101, 44], list(range(30, 90))]  # the second > window


@pytest.fixture(scope="module", params=["qwen3", "gemma2", "gemma3", "phi3"])
def new_family(request, tmp_path_factory):
    """(transformers' model, the folder it was saved in), one per family for the tests below."""
    folder = tmp_path_factory.mktemp(request.param)
    return save_random(request.param, folder), folder


def test_new_family_matches_transformers(new_family):
    hf, folder = new_family
    llm = LLM(model=str(folder), dtype="float32", kv_cache_tokens=1024, block_size=8, compile="off")
    assert llm.engine.runner.quantization == "none"
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    for attempt in range(2):  # the second time the prompts' blocks come from the prefix cache
        outs = llm.generate(NEW_PROMPTS, params)
        for prompt, out in zip(NEW_PROMPTS, outs, strict=True):
            got_tokens = out.outputs[0].token_ids
            tokens, logprobs = reference(hf, prompt, got_tokens)
            assert got_tokens == tokens
            got = [d["logprob"] for d in out.outputs[0].logprobs]
            assert got == pytest.approx(logprobs, abs=1e-4)
            assert (out.num_cached_tokens > 0) == (attempt == 1)


def test_new_family_runs_quantized(new_family):
    """int8 projections: the same model, so its first token's logprob stays near transformers'."""
    hf, folder = new_family
    llm = LLM(model=str(folder), dtype="float32", quantization="int8", kv_cache_tokens=1024, compile="off")
    assert llm.engine.runner.quantization == "int8"
    out = llm.generate(
        NEW_PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    )
    first = out[0].outputs[0].logprobs[0]
    with torch.no_grad():
        expected = hf(torch.tensor([NEW_PROMPTS[0]])).logits[0, -1].log_softmax(-1)[first["token_id"]]
    assert len(out[0].outputs[0].token_ids) == 6
    assert first["logprob"] == pytest.approx(float(expected), abs=0.05)


def write_config(folder, **fields) -> str:
    (folder / "config.json").write_text(json.dumps({**NEW, "num_attention_heads": 4, **fields}))
    return str(folder)


def test_phi3_longrope_is_refused(tmp_path):
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
    }
    model = write_config(tmp_path, architectures=["Phi3ForCausalLM"], model_type="phi3", rope_scaling=rope,
                         original_max_position_embeddings=128)  # fmt: skip
    with pytest.raises(ValueError, match="LongRoPE"):
        LLM(model=model, load_format="dummy", kv_cache_tokens=512)


def test_gemma2_refuses_attention_sinks(tmp_path):
    model = write_config(tmp_path, architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16)
    with pytest.raises(ValueError, match="soft-caps"):
        LLM(model=model, load_format="dummy", kv_cache_tokens=512, attention_sinks=4)


def test_multimodal_gemma3_is_refused_with_a_hint(tmp_path):
    model = write_config(tmp_path, architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3")
    with pytest.raises(ValueError, match="Gemma3ForCausalLM"):
        LLM(model=model, load_format="dummy", kv_cache_tokens=512)
