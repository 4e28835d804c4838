"""Prefix-cache hits, sampling options, aborts and bad input on the real engine."""

from __future__ import annotations

import pytest

from backend import LLM, InvalidParameter, SamplingParams
from backend.engine import ContextLengthExceeded

BS = 16


def greedy(n: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def assert_no_leak(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_cached_tokens_follow_the_block_math(llm):
    base = list(range(1000, 1100))  # 100 tokens
    first = llm.generate([base], greedy(2), cache_salt="math")[0]
    assert first.num_cached_tokens == 0
    again = llm.generate([base], greedy(2), cache_salt="math")[0]
    assert again.num_cached_tokens == (100 - 1) // BS * BS  # 96: six full blocks
    shared = llm.generate([base[:40] + list(range(5000, 5030))], greedy(2), cache_salt="math")[0]
    assert shared.num_cached_tokens == 32  # 40 shared tokens hold two full blocks
    exact = llm.generate([base[:64]], greedy(2), cache_salt="math")[0]
    assert exact.num_cached_tokens == 48  # all 4 blocks cached, but the last token is recomputed
    other_tenant = llm.generate([base], greedy(2), cache_salt="someone-else")[0]
    assert other_tenant.num_cached_tokens == 0
    assert_no_leak(llm)


def test_second_chat_turn_hits_the_first_turns_generated_tokens(llm):
    conv = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me a short story about a cat who learns to swim."},
    ]
    p1 = llm.chat_prompt_ids(conv)
    out1 = llm.generate([p1], greedy(48), cache_salt="chat")[0]
    reply = out1.outputs[0]
    conv2 = conv + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "And then?"}]
    p2 = llm.chat_prompt_ids(conv2)
    out2 = llm.generate([p2], greedy(4), cache_salt="chat")[0]
    # The block math: full blocks of turn 1 whose K/V were computed (all but the last sampled
    # token), as far as turn 2 repeats turn 1's tokens.
    seq1 = p1 + reply.token_ids
    common = next(
        (i for i, (a, b) in enumerate(zip(seq1, p2, strict=False)) if a != b), min(len(seq1), len(p2))
    )
    expected_blocks = min(common // BS, (len(seq1) - 1) // BS, (len(p2) - 1) // BS)
    assert out2.num_cached_tokens == expected_blocks * BS
    assert out2.num_cached_tokens > len(p1) // BS * BS, "the hit must reach into the generated tokens"


def test_stop_strings_cut_the_text(llm):
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    plain = llm.chat(conv, greedy(24))[0].outputs[0]
    assert "Paris" in plain.text
    out = llm.chat(conv, greedy(24, stop=["Paris"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert out.text == plain.text[: plain.text.index("Paris")]


def test_stop_token_ids_and_eos(llm):
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    plain = llm.chat(conv, greedy(24))[0].outputs[0]
    assert plain.finish_reason == "stop" and plain.token_ids[-1] in llm.engine.eos_token_ids
    stop_at = plain.token_ids[2]
    out = llm.chat(conv, greedy(24, stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == plain.token_ids[:3] and out.stop_reason == stop_at
    ignored = llm.chat(conv, greedy(40, ignore_eos=True))[0].outputs[0]
    assert len(ignored.token_ids) == 40 and ignored.finish_reason == "length"


def test_max_tokens_is_exact(llm):
    for n in (1, 5):
        out = llm.generate(
            "Once upon a time", SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        )[0]
        assert len(out.outputs[0].token_ids) == n and out.outputs[0].finish_reason == "length"


def test_seed_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate("The weather today is", p)[0].outputs[0].token_ids
    crowd = llm.generate(
        ["Tell me a joke", "The weather today is", "List fruits"],
        [SamplingParams(temperature=1.0, max_tokens=30), p, greedy(10)],
    )
    assert crowd[1].outputs[0].token_ids == alone
    other = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24, seed=99, ignore_eos=True)
    assert llm.generate("The weather today is", other)[0].outputs[0].token_ids != alone


def test_logprobs_of_the_chosen_token(llm):
    out = llm.generate("The capital of France is", greedy(6, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry["token_id"] == token and entry["logprob"] <= 0
        ids, lps = zip(*entry["top"], strict=True)
        assert len(ids) == 3 and ids[0] == token  # greedy picks the most likely token
        assert list(lps) == sorted(lps, reverse=True) and abs(lps[0] - entry["logprob"]) < 1e-5


def test_abort_frees_blocks_at_any_point(llm):
    eng = llm.engine
    for rid in ("a1", "a2", "a3"):
        eng.add_request(
            rid, "Write a long essay about rivers.", SamplingParams(max_tokens=200, ignore_eos=True)
        )
    eng.step()
    assert eng.abort_request("a2")  # running
    eng.step()
    assert eng.abort_request("a1") and eng.abort_request("a3")
    assert not eng.abort_request("a3") and not eng.abort_request("unknown")
    assert_no_leak(llm)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**63}, "top_k"),  # a tensor of it would overflow inside the step
        ({"temperature": float("nan")}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"n": 2}, "n"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_values_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_bad_prompts_are_refused_before_they_run(llm):
    eng = llm.engine
    with pytest.raises(ContextLengthExceeded) as err:
        eng.add_request("long", [1] * eng.max_model_len, SamplingParams())
    assert str(eng.max_model_len) in str(err.value) and err.value.param == "prompt"
    with pytest.raises(ContextLengthExceeded) as err:
        eng.add_request("long2", [1] * 100, SamplingParams(max_tokens=eng.max_model_len))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidParameter):
        eng.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidParameter):
        eng.add_request("vocab", [10**9], SamplingParams())
    assert_no_leak(llm)
