"""n > 1, best_of, echo with prompt logprobs, penalties and logit_bias through the real openai SDK
against the built-in engine's server (the session's shared backend: no model of its own)."""

from __future__ import annotations

import json
from collections import defaultdict

import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "Name a colour."}]
PROMPT = "The three primary colours are"
PROMPT_IDS = [504, 1296, 3003, 14797, 359]  # PROMPT in SmolLM2's tokenizer
COLON = 42  # ":"


@pytest.fixture(scope="module")
def client(shared_backend_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_backend_url, api_key="unused", max_retries=0, timeout=600)


def test_n_samples_are_indexed_and_reproducible_with_a_seed(client: openai.OpenAI) -> None:
    """Each sample has its own seed (seed + index): the same request gives the same three answers,
    and they differ from one another. Usage counts the prompt once and every sample's tokens.
    The first request prefills its question (no other test asks it; the chat template's opening may be
    cached already), the repeat finds the question in the prefix cache too and computes only its tail:
    the same logits, so the same draws."""
    question = [{"role": "user", "content": "Name a colour, any colour you like."}]
    kw = {"model": MODEL, "messages": question, "n": 3, "seed": 7, "temperature": 1.0, "max_tokens": 6}
    first = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw, logprobs=True)  # logprobs change nothing drawn
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, again)]
    assert cached[1] > cached[0]  # the repeat's question itself came from the prefix cache
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in again.choices)
    single = client.chat.completions.create(**{**kw, "n": 1, "max_tokens": 1})
    assert first.usage.prompt_tokens == single.usage.prompt_tokens


def test_streamed_choices_carry_their_index_and_match_the_answer(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "messages": QUESTION, "n": 2, "seed": 11, "temperature": 1.0, "max_tokens": 8}
    whole = client.chat.completions.create(**kw)
    text: dict[int, str] = defaultdict(str)
    roles, finishes = set(), {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert roles == {0, 1} and set(finishes) == {0, 1}
    assert [text[0], text[1]] == [c.message.content for c in whole.choices]


def test_best_of_returns_the_samples_with_the_highest_cumulative_logprob(client: openai.OpenAI) -> None:
    """best_of=3 draws the same three samples as n=3 (same seeds), and returns the two whose
    tokens' logprobs sum highest, in their original order; all three samples are billed."""
    kw = {"model": MODEL, "prompt": PROMPT, "seed": 3, "temperature": 1.0, "max_tokens": 6}
    drawn = client.completions.create(**kw, n=3, logprobs=0)
    ranked = sorted(drawn.choices, key=lambda c: -sum(c.logprobs.token_logprobs))[:2]
    best = client.completions.create(**kw, n=2, best_of=3)
    assert [c.text for c in best.choices] == [c.text for c in sorted(ranked, key=lambda c: c.index)]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == drawn.usage.completion_tokens


def test_echo_scores_the_prompt_without_generating(client: openai.OpenAI) -> None:
    """The loglikelihood request of evaluation harnesses: echo, logprobs, max_tokens 0."""
    out = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    c = out.choices[0]
    lp = c.logprobs
    assert c.text == PROMPT and out.usage.completion_tokens == 0
    assert len(lp.tokens) == out.usage.prompt_tokens == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == PROMPT
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # top_logprobs hold the most likely token, and the token itself with its own logprob
    assert all(lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i] for i in range(1, len(lp.tokens)))


def test_echo_with_a_completion_and_in_a_stream(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 4, "temperature": 0}
    whole = client.completions.create(**kw).choices[0]
    prompt_tokens = client.completions.create(**{**kw, "max_tokens": 0}).usage.prompt_tokens
    assert whole.text.startswith(PROMPT) and len(whole.text) > len(PROMPT)
    assert len(whole.logprobs.tokens) == prompt_tokens + 4
    assert whole.logprobs.text_offset[prompt_tokens] == len(PROMPT)
    chunks = list(client.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].text == PROMPT
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.text


def test_logit_bias_and_penalties_steer_greedy_output(client: openai.OpenAI) -> None:
    """A +100 bias makes one token the argmax every step; a frequency penalty then stops it repeating.
    The logprobs stay the model's own: those echo scoring gives the same tokens."""
    kw = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0, "logprobs": 0}
    forced = client.completions.create(**kw, logit_bias={str(COLON): 100}).choices[0]
    assert forced.text == "::::"
    scored = client.completions.create(  # a list of one token list, as lm-eval sends prompts
        model=MODEL, prompt=[PROMPT_IDS + [COLON] * 4], echo=True, logprobs=0, max_tokens=0
    ).choices[0]
    # Decoding a token (the fused step) and scoring it inside a prefill (the modules) give its logits the
    # same bits, so the logprobs agree to the log-softmax's own rounding (equal here); a bias leaking
    # into them would move them to about 0.
    assert forced.logprobs.token_logprobs == pytest.approx(scored.logprobs.token_logprobs[-4:], abs=1e-5)
    plain = client.completions.create(**kw).choices[0]
    assert ":" not in plain.text
    steered = {"logit_bias": {str(COLON): 5.0}, "frequency_penalty": 2.0}
    penalised = client.completions.create(**kw, **steered).choices[0]
    assert penalised.text != forced.text and penalised.text != plain.text


def test_each_sample_follows_its_own_copy_of_the_grammar(client: openai.OpenAI) -> None:
    """A forked sample gets a copy of the response_format matcher: every choice is valid JSON."""
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, n=3, seed=5, temperature=1.0, max_tokens=20, response_format=fmt
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c in out.choices:
        assert json.loads(c.message.content)["colour"] in {"red", "green", "blue"}
        assert c.finish_reason == "stop"
