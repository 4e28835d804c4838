"""Latent attention (DeepSeek-V2/V3) in the real engine, on tiny random checkpoints saved by transformers.

The engine's greedy tokens equal transformers' generate, and its logprobs equal a transformers forward
pass over prompt + output, in float32, with decodes in the absorbed form and in the expanded one. The
paged cache holds one latent row per token (kv_lora_rank + qk_rope_head_dim), and the byte budget,
prefix caching, forks, n-gram drafts and the RAM and disk tiers work on it; settings that assume
per-head K/V are refused at start.
"""

from __future__ import annotations

import gc

import pytest
import torch

from cachegw.backend import LLM, SamplingParams
from cachegw.backend.executor.layers.mla_attention import MLAttention

SHAPE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
    initializer_range=0.05, tie_word_embeddings=False,
)  # fmt: skip
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}  # fmt: skip
BS = 8
ROW = 32 + 8  # kv_lora_rank + qk_rope_head_dim
PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 8, 100, 101, 44], list(range(30, 90))]


def save(kind: str, folder) -> torch.nn.Module:
    """V2: queries from q_proj, every layer dense; V3: a query bottleneck (q_lora_rank), YaRN rope (its
    softmax mscale too), then MoE layers with grouped sigmoid routing and a correction bias."""
    from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

    if kind == "v2":
        cfg = DeepseekV2Config(**SHAPE, q_lora_rank=None, first_k_dense_replace=3)
    else:
        cfg = DeepseekV3Config(
            **SHAPE, **MOE, q_lora_rank=24, first_k_dense_replace=1, n_group=2, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=YARN,
        )  # fmt: skip
    cfg.architectures = [f"Deepseek{kind.upper()}ForCausalLM"]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # a bias that changes which experts are chosen
        for layer in hf.model.layers[cfg.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    hf.save_pretrained(str(folder))
    return hf


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-v2")
    return str(folder), save("v2", folder)


def engine(model: str, **kw) -> LLM:
    return LLM(model=model, dtype="float32", device="cpu", block_size=BS, **{"kv_cache_tokens": 1024, **kw})


@pytest.fixture
def expanded_decode():
    MLAttention.absorb = False
    yield
    MLAttention.absorb = True


def check_against_transformers(llm: LLM, hf) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        got = out.outputs[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                              pad_token_id=0)  # fmt: skip
            assert got.token_ids == ref[0, len(prompt) :].tolist()
            logits = hf(torch.tensor([prompt + got.token_ids])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(got.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([d["logprob"] for d in got.logprobs]), want, atol=1e-4)


@pytest.mark.parametrize("decode", ["absorbed", "expanded"])
def test_deepseek_v2_matches_transformers(v2, decode, request):
    if decode == "expanded":
        request.getfixturevalue("expanded_decode")
    check_against_transformers(engine(v2[0]), v2[1])


def test_deepseek_v3_with_moe_matches_transformers(tmp_path):
    hf = save("v3", tmp_path)
    llm = engine(str(tmp_path))
    assert sum(type(layer.mlp).__name__ == "DeepseekMoE" for layer in llm.engine.runner.model.layers) == 2
    check_against_transformers(llm, hf)


def test_the_pool_holds_one_latent_row_per_token_and_bytes_count_it(v2):
    llm = engine(v2[0], kv_cache_tokens=None, kv_cache_bytes=64 * 3 * ROW * 4 * BS)
    runner = llm.engine.runner
    assert runner.kv_bytes_per_token == 3 * ROW * 4  # layers x (latent + rope) x float32, one part
    assert runner.num_blocks == 64
    assert [tuple(c.shape) for c in runner.kv_caches[0]] == [(64, BS, 1, ROW)]
    assert tuple(runner.read_block(0).shape) == (3, 1, BS, 1, ROW)


def test_a_shared_prefix_is_reused(v2):
    llm = engine(v2[0])
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    shared = list(range(40, 80))
    first, second = (llm.generate(shared + tail, greedy)[0] for tail in ([3, 4, 5], [9, 8]))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 40
    fresh = engine(v2[0], enable_prefix_caching=False).generate(shared + [9, 8], greedy)[0]
    assert second.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_a_block_spilled_to_ram_comes_back_with_the_same_tokens(v2):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt, other = list(range(10, 60)), list(range(100, 150))
    reference = engine(v2[0]).generate(prompt, greedy)[0].outputs[0].token_ids
    llm = engine(v2[0], kv_cache_tokens=64, kv_offload_bytes=1 << 20)  # 8 blocks: one prompt at a time
    llm.generate(prompt, greedy)
    llm.generate(other, greedy)  # evicts the first prompt's blocks into RAM
    out = llm.generate(prompt, greedy)[0]
    assert out.num_cached_tokens == 48 and out.outputs[0].token_ids == reference
    assert llm.engine.stats().prefix_cache_hits_by_tier["ram"] > 0
    del llm
    gc.collect()


def test_a_restart_finds_the_latent_blocks_on_disk(v2, tmp_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt, tier = (
        list(range(10, 60)),
        dict(kv_cache_tokens=64, kv_offload_bytes=0, kv_offload_dir=str(tmp_path)),
    )
    first = engine(v2[0], **tier)
    reference = first.generate(prompt, greedy)[0].outputs[0].token_ids
    first.engine.close()  # the pool's blocks go to disk
    restarted = engine(v2[0], **tier)
    out = restarted.generate(prompt, greedy)[0]
    assert out.num_cached_tokens == 48 and out.outputs[0].token_ids == reference
    assert restarted.engine.stats().prefix_cache_hits_by_tier["disk"] == 48


def test_forked_samples_and_draft_tokens_give_greedy_tokens(v2):
    """n > 1 copies a partly filled latent block; n-gram drafts are multi-token chunks over the cache."""
    prompt, greedy = [5, 6, 7, 8] * 10, dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = engine(v2[0])
    plain = llm.generate(prompt, SamplingParams(**greedy))[0].outputs[0].token_ids
    forked = llm.generate(prompt, SamplingParams(**greedy, n=2), cache_salt="fork")[0].outputs
    assert [o.token_ids for o in forked] == [plain, plain]
    drafting = engine(v2[0], speculative="ngram", num_speculative_tokens=4)
    assert drafting.generate(prompt, SamplingParams(**greedy))[0].outputs[0].token_ids == plain
    assert drafting.engine.spec_accepted_tokens > 0


@pytest.mark.parametrize(
    "setting",
    [{"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp8"}, {"quantization": "int8"}, {"attention_sinks": 4}],
)
def test_settings_latent_attention_cannot_use_are_refused(v2, setting):
    with pytest.raises(ValueError, match=f"latent attention.*{next(iter(setting))}"):
        engine(v2[0], **setting)
