"""Greedy outputs of our engine equal Hugging Face `generate` on the same weights, token for token.

Run as one batch, with some requests served partly from the prefix cache, with chunked prefill,
and with a KV cache so small that requests are preempted and recomputed.
"""

from __future__ import annotations

import pytest
import torch

from cachegw.backend import LLM, SamplingParams

NEW_TOKENS = 24
SYSTEM = "You are a concise assistant. Answer in one or two sentences and do not use lists."
DOC = (
    "The Rhine is a major European river that rises in the Swiss Alps, forms part of the Swiss-Austrian, "
    "Swiss-Liechtenstein, Swiss-German and then the Franco-German border, then flows through the German "
    "Rhineland and the Netherlands, and empties into the North Sea. It is about 1,230 km long. "
) * 3


def prompts_for(llm: LLM) -> list[list[int]]:
    questions = [
        "What is the capital of France?",
        "Name three primary colors.",
        "Write a haiku about the sea.",
        "Why is the sky blue? Explain briefly.",
        "How many legs does a spider have?",
    ]
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions]
    convs += [
        [{"role": "user", "content": f"{DOC}\nHow long is the Rhine?"}],
        [{"role": "user", "content": f"{DOC}\nWhere does the Rhine end?"}],
        [{"role": "user", "content": "Count: 1 2 3 4"}],
    ]
    return [llm.chat_prompt_ids(c) for c in convs]


def hf_greedy(hf_model, prompt: list[int], eos: set[int]) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=sorted(eos), pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def reference(llm, hf_model):
    prompts = prompts_for(llm)
    return prompts, [hf_greedy(hf_model, p, llm.engine.eos_token_ids) for p in prompts]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def test_batch_matches_hf_with_prefix_hits(llm, reference):
    prompts, expected = reference
    llm.generate(prompts[0], greedy())  # warms the cache: prompts 1-4 share its system prompt
    llm.generate(prompts[5], greedy())  # ... and prompt 6 shares prompt 5's long document
    outs = llm.generate(prompts, greedy())
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(outs[i].num_cached_tokens >= 16 for i in range(5))
    assert outs[6].num_cached_tokens >= 16 * ((len(prompts[5]) - 20) // 16)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)


def test_preempted_and_chunked_requests_match_hf(reference):
    prompts, expected = reference
    need = max(len(p) for p in prompts) + NEW_TOKENS
    small = LLM(
        dtype="float32",
        quantization="none",
        kv_cache_tokens=need + 64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    outs = small.generate(prompts, greedy())
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = small.engine.stats()
    assert stats.num_preemptions > 0, "the KV cache was meant to be too small for the batch"
    assert any(o.metrics.num_preemptions for o in outs)
    assert small.engine.block_manager.num_free_blocks == small.engine.block_manager.num_blocks
    assert not small.engine.scheduler.running and not small.engine.scheduler.waiting


def test_echo_prompt_logprobs_match_an_hf_forward_pass(llm, hf_model) -> None:
    """Prompt logprobs through the server (the openai SDK, echo + logprobs + max_tokens 0, as
    evaluation harnesses score loglikelihood) equal log_softmax of HF's logits on the same weights:
    the module's float32 engine behind its own HTTP server for this test (the session's shared one
    runs int4)."""
    import openai

    from cachegw.backend.core.async_engine import AsyncEngine
    from cachegw.backend.entrypoints.server import build_app
    from testkit.servers import serve_in_thread

    ids = prompts_for(llm)[5]  # the long document: several blocks, every position scored
    engine = AsyncEngine(llm.engine)
    try:
        with serve_in_thread(build_app(engine, "SmolLM2-135M-Instruct", 1 << 20)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
            out = client.completions.create(
                model="SmolLM2-135M-Instruct", prompt=ids, echo=True, logprobs=1, max_tokens=0
            )
    finally:
        engine.shutdown()
    got = out.choices[0].logprobs.token_logprobs
    with torch.inference_mode():
        lp = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    expected = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert got[0] is None and len(got) == len(ids)
    assert max(abs(a - b) for a, b in zip(got[1:], expected, strict=True)) < 1e-3
