"""Speculative decoding on the real SmolLM2 engine: output token for token the same as plain decoding
(greedy) where drafts are accepted and where they are not, with penalties, logit_bias, stop strings,
max_tokens, a preemption in the middle, a request's own draft, and prefix hits on the blocks verified
steps wrote.

One engine (the module's ``llm``) runs both ways: its speculator is switched on per call."""

from __future__ import annotations

import pytest

from cachegw.backend import LLM, SamplingParams
from cachegw.backend.core.sampling_params import StructuredOutput
from cachegw.backend.core.sequence import Sequence
from cachegw.backend.core.speculative import Speculator

SPEC = Speculator(num_tokens=4, ngram_min=2, ngram_max=4)
TEXT = (
    "The quick brown fox jumps over the lazy dog. The dog was not amused and barked loudly at the fox. "
    "Then the fox ran into the forest, where it met a bear who was eating honey from a tree."
)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> dict[str, list[int]]:
    return {
        "repeat": llm.chat_prompt_ids([{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]),
        "open": llm.chat_prompt_ids([{"role": "user", "content": "Name a colour and say why you like it."}]),
    }


def cases(llm: LLM, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], SamplingParams]]:
    fox = llm.tokenizer.encode(" fox", add_special_tokens=False)[0]
    greedy = {"temperature": 0.0, "max_tokens": 24}
    return {
        "repeat": (prompts["repeat"], SamplingParams(**greedy)),
        "open": (prompts["open"], SamplingParams(**greedy)),
        "preempted": (prompts["repeat"], SamplingParams(**greedy)),
        "penalized": (
            prompts["repeat"],
            SamplingParams(**greedy | {"frequency_penalty": 0.4, "logit_bias": {fox: 3.0}}),
        ),
        "stop": (prompts["repeat"], SamplingParams(**greedy | {"stop": ["barked loudly"]})),
        "short": (prompts["repeat"], SamplingParams(temperature=0.0, max_tokens=14)),  # ends amid drafts
        "sampled": (prompts["repeat"], SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12)),
    }


def text(seq: Sequence) -> str:
    return seq.detokenizer.visible_text(True)


def run(llm: LLM, batch: dict[str, tuple[list[int], SamplingParams]], preempt: str | None = None) -> dict:
    """Every case as one batch; the ``preempt`` one is preempted after 8 tokens, as the scheduler
    does when blocks run out. Returns each case's first sequence."""
    engine = llm.engine
    seqs = {k: engine.add_request(f"spec-{k}", p, params) for k, (p, params) in batch.items()}
    while engine.has_unfinished_requests():
        engine.step()
        victim = seqs.get(preempt or "")
        if victim is not None and victim.num_output_tokens >= 8 and not victim.num_preemptions:
            engine.scheduler.running.remove(victim)
            engine.scheduler._preempt(victim)
            assert victim.num_computed_tokens == 0 and not victim.block_table
    return seqs


@pytest.fixture(scope="module")
def outputs(llm: LLM, prompts) -> tuple[dict, dict]:
    batch = cases(llm, prompts)
    expected = run(llm, batch)
    # The gateway's draft: here the very answer plain decoding gave (a near miss's would be close to it).
    draft = SamplingParams(temperature=0.0, max_tokens=24, draft=text(expected["open"]))
    batch["drafted"] = (prompts["open"], draft)
    llm.engine.speculator = SPEC
    llm.engine.scheduler.speculative_max_seqs = len(batch) + 1  # the whole batch speculates
    try:
        got = run(llm, batch, preempt="preempted")
    finally:
        llm.engine.speculator = None
        llm.engine.scheduler.speculative_max_seqs = 1
    return expected, got


def test_greedy_output_is_plain_decodings_where_drafts_are_accepted_and_where_not(outputs) -> None:
    expected, got = outputs
    for k in ("repeat", "open", "preempted"):
        assert got[k].output_token_ids == expected[k].output_token_ids, k
        assert got[k].finish_reason == expected[k].finish_reason
    assert got["repeat"].spec.accepted >= 12  # the copy is mostly drafted: half of 24 tokens or more
    assert got["open"].spec.accepted <= got["open"].spec.drafted // 2  # few or no drafts hold
    assert got["preempted"].num_preemptions == 1 and got["preempted"].spec.accepted >= 6


def test_a_request_draft_is_proposed_before_prompt_lookup(outputs) -> None:
    expected, got = outputs
    assert got["drafted"].output_token_ids == expected["open"].output_token_ids
    assert got["drafted"].spec.accepted >= 16  # most tokens after the first came from the draft
    assert got["drafted"].spec.accepted > 2 * got["open"].spec.accepted


def test_penalties_logit_bias_stop_strings_and_max_tokens_hold_with_drafts(outputs) -> None:
    expected, got = outputs
    for k in ("penalized", "stop", "short"):
        g, e = got[k], expected[k]
        assert (g.output_token_ids, text(g), g.finish_reason) == (
            e.output_token_ids,
            text(e),
            e.finish_reason,
        ), k
    assert got["stop"].finish_reason == "stop" and "barked" not in text(got["stop"])
    assert got["short"].num_output_tokens == 14 and got["short"].spec.accepted


def test_sampled_and_structured_requests(llm, prompts, outputs) -> None:
    """Sampled samples (n = 2) stop at max_tokens; a grammar's sequence gets no drafts."""
    _, got = outputs
    assert 0 < got["sampled"].num_output_tokens <= 12
    llm.engine.speculator = SPEC
    try:
        seq = llm.engine.add_request(
            "json",
            prompts["repeat"],
            SamplingParams(max_tokens=4, structured=StructuredOutput("json_object")),
        )
    finally:
        llm.engine.speculator = None
    assert seq.spec is None
    llm.engine.abort_request("json")


def test_blocks_written_by_verified_steps_serve_prefix_hits(llm, prompts, outputs) -> None:
    """Only accepted tokens' blocks are hashed, so the next turn's prefix hit reads true K/V."""
    _, got = outputs
    turn = got["repeat"].token_ids
    params = SamplingParams(temperature=0.0, max_tokens=4)
    hit = llm.generate([turn], params)[0]
    assert hit.num_cached_tokens > len(prompts["repeat"])  # blocks of generated tokens were reused
    llm.engine.block_manager.reset_prefix_cache()
    fresh = llm.generate([turn], params)[0]
    assert fresh.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == fresh.outputs[0].token_ids
