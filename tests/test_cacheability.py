"""Cacheability: every header and body case of the table in policies/cacheability.py, with the
expected (may_serve, may_store, reason)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from cachegw.policies.cacheability import Cacheability, CachePolicy, decide, exact_only, judge_answer

ROOT = Path(__file__).resolve().parents[1]
STRICT = CachePolicy()
SAMPLING_OK = CachePolicy(serve_temperature_above_zero=True)
UNSET_OK = CachePolicy(serve_unset_temperature=True)  # the operator's trade-off for unset temperatures
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "Once upon", "temperature": 0}


def check(body: dict[str, Any], headers: dict[str, str] | None = None, policy: CachePolicy = STRICT) -> tuple:
    d = decide(body, headers or {}, policy)
    assert isinstance(d, Cacheability)
    return d.may_serve, d.may_store, d.reason


def test_defaults_match_config_toml() -> None:
    with open(ROOT / "config.toml", "rb") as f:
        section = tomllib.load(f)["cache"]
    assert CachePolicy.from_dict(section) == CachePolicy()
    assert CachePolicy.from_dict({**section, "serve_temperature_above_zero": True}) == SAMPLING_OK


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, (True, True, "ok")),
        ({"Cache-Control": "no-cache"}, (False, True, "no-cache")),
        ({"cache-control": "No-Cache"}, (False, True, "no-cache")),
        ({"CACHE-CONTROL": "max-age=0"}, (False, True, "no-cache")),
        ({"Cache-Control": "max-age=60"}, (True, True, "ok")),
        ({"Cache-Control": "no-store"}, (False, False, "no-store")),
        ({"Cache-Control": "max-age=0, no-store"}, (False, False, "no-store")),
        ({"Cache-Control": "no-cache,no-store"}, (False, False, "no-store")),
        ({"Cache-Control": ' private , NO-STORE="x" '}, (False, False, "no-store")),
        ({"Cache-Control": "only-if-cached"}, (True, True, "ok")),
        ({"Pragma": "no-cache"}, (False, True, "no-cache")),
        ({"Pragma": "no-cache", "Cache-Control": "max-age=60"}, (True, True, "ok")),  # RFC 9111 5.4
        ({"X-Other": "no-store"}, (True, True, "ok")),
    ],
)
def test_request_headers(headers: dict[str, str], expected: tuple) -> None:
    assert check(CHAT, headers) == expected


def test_repeated_headers_are_all_read() -> None:
    class MultiHeaders(dict):  # what Starlette's Headers.items() yields for a repeated header
        def items(self):  # type: ignore[override]
            return [("cache-control", "max-age=60"), ("cache-control", "no-store")]

    assert decide(CHAT, MultiHeaders(), STRICT) == Cacheability(False, False, "no-store")


@pytest.mark.parametrize(
    ("change", "policy", "expected"),
    [
        ({}, STRICT, (True, True, "ok")),
        ({"n": 1}, STRICT, (True, True, "ok")),
        ({"n": 1.0}, STRICT, (True, True, "ok")),
        ({"n": 2.0}, STRICT, (False, False, "n>1")),
        ({"temperature": 0.7, "top_k": 1.0}, STRICT, (True, True, "ok")),
        ({"n": None}, STRICT, (True, True, "ok")),
        ({"n": 2}, STRICT, (False, False, "n>1")),
        ({"n": 3}, SAMPLING_OK, (False, False, "n>1")),
        ({"temperature": 0.0}, STRICT, (True, True, "ok")),
        ({"temperature": 0.7}, STRICT, (False, False, "temperature")),
        ({"temperature": None}, STRICT, (False, False, "temperature")),  # null = OpenAI's default 1.0
        ({"temperature": 0.7}, SAMPLING_OK, (True, True, "ok")),
        ({"temperature": None}, UNSET_OK, (True, True, "ok")),
        ({"temperature": 0.7}, UNSET_OK, (False, False, "temperature")),  # asked for a sample explicitly
        ({"temperature": 1.0}, UNSET_OK, (False, False, "temperature")),
        ({"temperature": 0.7, "seed": 42}, STRICT, (False, False, "temperature")),
        ({"temperature": 0.7, "seed": 42}, SAMPLING_OK, (True, True, "ok")),
        ({"temperature": 0.7, "top_k": 1}, STRICT, (True, True, "ok")),  # greedy after all
        ({"temperature": 0.7, "top_k": 5}, STRICT, (False, False, "temperature")),
        ({"temperature": 0, "top_p": 0.5, "seed": 1}, STRICT, (True, True, "ok")),
        ({"logprobs": True}, STRICT, (False, False, "logprobs")),
        ({"logprobs": True, "top_logprobs": 3}, SAMPLING_OK, (False, False, "logprobs")),
        ({"logprobs": False}, STRICT, (True, True, "ok")),
        ({"logprobs": False, "top_logprobs": None}, STRICT, (True, True, "ok")),
        ({"top_logprobs": 0}, STRICT, (False, False, "logprobs")),
        (
            {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]},
            STRICT,
            (True, True, "ok"),
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, STRICT, (True, True, "ok")),
        ({"stream": True}, STRICT, (True, True, "ok")),
        ({"stream": True, "stream_options": {"include_usage": True}}, STRICT, (True, True, "ok")),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            STRICT,
            (False, True, "stream-options"),
        ),
        ({"n": 0}, STRICT, (False, False, "invalid")),
        ({"n": True}, STRICT, (False, False, "invalid")),
        ({"n": "2"}, STRICT, (False, False, "invalid")),
        ({"temperature": -1}, STRICT, (False, False, "invalid")),
        ({"temperature": "0"}, STRICT, (False, False, "invalid")),
        ({"top_k": 1.5}, STRICT, (False, False, "invalid")),
        ({"logprobs": 2}, STRICT, (False, False, "invalid")),  # chat logprobs is a bool
        ({"top_logprobs": "3"}, STRICT, (False, False, "invalid")),
    ],
)
def test_chat_body(change: dict[str, Any], policy: CachePolicy, expected: tuple) -> None:
    assert check({**CHAT, **change}, policy=policy) == expected


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({}, (True, True, "ok")),
        ({"logprobs": None}, (True, True, "ok")),
        ({"logprobs": 0}, (False, False, "logprobs")),  # 0 still returns the chosen tokens' logprobs
        ({"logprobs": 5}, (False, False, "logprobs")),
        ({"n": 2}, (False, False, "n>1")),
        ({"echo": True, "suffix": "x"}, (True, True, "ok")),
        ({"temperature": 1}, (False, False, "temperature")),
        ({"prompt": ["Once", "Twice"]}, (False, False, "n>1")),  # an entry holds one prompt's answer
        ({"prompt": [[1, 2], [3]]}, (False, False, "n>1")),
        ({"prompt": ["Once"]}, (True, True, "ok")),
        ({"prompt": [1, 2, 3]}, (True, True, "ok")),  # token ids: one prompt
        ({"n": 10**400}, (False, False, "n>1")),  # was an OverflowError (500) in float(n)
        ({"top_k": 10**400}, (True, True, "ok")),  # the backend refuses it; no stored answer has its key
    ],
)
def test_completion_body(change: dict[str, Any], expected: tuple) -> None:
    assert check({**COMPLETION, **change}) == expected


def test_absent_temperature_means_sampling() -> None:
    body = {k: v for k, v in CHAT.items() if k != "temperature"}
    assert check(body) == (False, False, "temperature")
    assert check(body, policy=SAMPLING_OK) == (True, True, "ok")


def test_the_most_restrictive_rule_wins() -> None:
    assert check({**CHAT, "n": 2}, {"Cache-Control": "no-store"}) == (False, False, "no-store")
    assert check({**CHAT, "temperature": 1}, {"Cache-Control": "no-cache"}) == (False, False, "temperature")
    assert check({**CHAT, "logprobs": True}, {"Cache-Control": "no-cache"}) == (False, False, "logprobs")
    options = {"stream_options": {"x": 1}}
    assert check({**CHAT, **options}, {"Cache-Control": "no-cache"}) == (False, True, "no-cache")
    assert check({**CHAT, "n": "x"}, {"Cache-Control": "no-store"}) == (False, False, "invalid")
    assert check(CHAT, policy=CachePolicy(enabled=False)) == (False, False, "disabled")


@pytest.mark.parametrize(
    ("cache_control", "max_age", "min_fresh"),
    [
        ("max-age=60", 60.0, 0.0),
        ("max-age=60, min-fresh=5", 60.0, 5.0),
        ("min-fresh=30", None, 30.0),
        ("max-age=abc", None, 0.0),  # not delta-seconds: ignored (RFC 9111 1.2.2)
        ("max-age=-5", None, 0.0),
        ("max-age=²", None, 0.0),
        ("max-stale=100", None, 0.0),  # never served stale anyway
    ],
)
def test_freshness_directives_are_carried_to_the_lookup(cache_control, max_age, min_fresh) -> None:
    d = decide(CHAT, {"Cache-Control": cache_control}, STRICT)
    assert (d.may_serve, d.fresh.max_age, d.fresh.min_fresh) == (True, max_age, min_fresh)


def test_only_no_store_keeps_nothing() -> None:
    assert decide(CHAT, {"Cache-Control": "no-store"}, STRICT).keeps_nothing
    assert not decide(CHAT, {"Cache-Control": "no-cache"}, STRICT).keeps_nothing
    assert not decide({**CHAT, "temperature": 1}, {}, STRICT).keeps_nothing


# ---- what answer may be stored (judge_answer) and which turns are exact-only -------------------

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}


def answer(message: dict[str, Any], finish: str | None = "stop", n: int = 1) -> dict[str, Any]:
    return {"choices": [{"index": i, "message": message, "finish_reason": finish} for i in range(n)]}


@pytest.mark.parametrize(
    ("response", "max_tokens", "expected"),
    [
        (answer({"role": "assistant", "content": "hi"}), None, (True, "ok", True)),
        (
            answer({"role": "assistant", "content": "hi", "tool_calls": [], "refusal": None}),
            None,
            (True, "ok", True),
        ),
        (
            answer({"role": "assistant", "content": None, "tool_calls": [CALL]}, "tool_calls"),
            None,
            (True, "ok", False),
        ),
        (
            answer({"role": "assistant", "tool_calls": [{"function": CALL["function"]}]}, "tool_calls"),
            None,
            (True, "ok", False),
        ),
        (
            answer({"role": "assistant", "content": None, "tool_calls": [CALL]}, "stop"),
            None,
            (True, "ok", False),
        ),
        (answer({"role": "assistant", "content": "hi"}, "length"), 8, (True, "ok", True)),
        (answer({"role": "assistant", "content": "hi"}, "length"), None, (False, "finish:length", True)),
        (
            answer({"role": "assistant", "content": None, "tool_calls": [CALL]}, "length"),
            8,
            (False, "finish:length", True),
        ),
        (answer({"role": "assistant", "content": "hi"}, None), None, (False, "finish:None", True)),
        (
            answer({"role": "assistant", "content": "hi"}, "content_filter"),
            None,
            (False, "finish:content_filter", True),
        ),
        (answer({"role": "assistant", "content": "hi"}, n=2), None, (False, "choices", True)),
        ({"choices": []}, None, (False, "choices", True)),
        (answer({"role": "assistant", "content": "", "refusal": "no"}), None, (False, "field:refusal", True)),
        (
            answer({"role": "assistant", "content": "hi", "reasoning_content": "hm"}),
            None,
            (False, "field:reasoning_content", True),
        ),
        (answer({"role": "assistant", "content": None}, "tool_calls"), None, (False, "tool-call", True)),
        (
            answer(
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": '{"ci'}}],
                },
                "tool_calls",
            ),
            None,
            (False, "tool-call", True),
        ),
        (
            answer({"role": "assistant", "tool_calls": [{**CALL, "id": ""}]}, "tool_calls"),
            None,
            (True, "ok", False),
        ),
        (
            answer({"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}, "tool_calls"),
            None,
            (False, "tool-call", True),
        ),
        (
            answer(
                {"role": "assistant", "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]}, "tool_calls"
            ),
            None,
            (False, "tool-call", True),
        ),
        (
            answer({"role": "assistant", "tool_calls": {"0": CALL}}, "tool_calls"),
            None,
            (False, "tool-call", True),
        ),
    ],
    ids=[
        "text",
        "vllm-empty-fields",
        "tool-calls",
        "call-without-type-or-id",
        "tool-calls-with-stop",
        "length-same-limit",
        "length-no-limit",
        "tool-calls-cut-short",
        "no-finish",
        "content-filter",
        "two-choices",
        "no-choice",
        "refusal",
        "reasoning",
        "tool_calls-without-calls",
        "arguments-not-json",
        "call-without-id-gets-one-on-replay",
        "not-a-function",
        "call-without-name",
        "calls-not-a-list",
    ],
)
def test_judge_answer(response: dict, max_tokens: int | None, expected: tuple) -> None:
    v = judge_answer(response, max_tokens)
    assert (v.store, v.reason, v.semantic) == expected


@pytest.mark.parametrize(
    ("last", "expected"),
    [
        ({"role": "user", "content": "hi"}, False),
        ({"role": "tool", "tool_call_id": "call_1", "content": "21C"}, True),
        ({"role": "assistant", "content": "Sure, "}, True),
    ],
)
def test_only_a_user_turn_is_compared_by_meaning(last: dict, expected: bool) -> None:
    assert exact_only({"messages": [{"role": "user", "content": "q"}, last]}) is expected
    assert exact_only({"prompt": "Once upon"}) is False
