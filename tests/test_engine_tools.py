"""Tool calling end to end: the real SmolLM2 engine behind its HTTP server (the session's shared one), the
real openai SDK, every call's arguments checked with jsonschema.

SmolLM2's template knows no tools, so these run the generic tool prompt; the grammar, not the 135M
model, makes each call name a listed function with valid arguments. Answers are greedy and short.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.tool_server import weather_tool

MODEL = "SmolLM2-135M-Instruct"
CALC = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": 40}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
WEATHER = weather_tool()
WEATHER["function"]["parameters"]["properties"]["city"]["maxLength"] = 24
WEATHER["function"]["parameters"]["properties"]["unit"] = {"enum": ["celsius", "fahrenheit"]}
WEATHER["function"]["parameters"]["additionalProperties"] = False  # bounded: no invented extra fields
TOOLS = [WEATHER, CALC]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "calculate"}}


@pytest.fixture(scope="module")
def client(shared_backend_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_backend_url, api_key="unused", max_retries=0, timeout=600)


def create(client: openai.OpenAI, messages: list[dict] = ASK, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=kw.pop("tools", TOOLS), temperature=0,
        max_tokens=kw.pop("max_tokens", 48), **kw,
    )  # fmt: skip


_ANSWERS: dict[str, Any] = {}


def answer(client: openai.OpenAI, tool_choice: Any) -> Any:
    """The JSON answer to ASK under ``tool_choice``, generated once for the module (greedy, so the same)."""
    key = json.dumps(tool_choice)
    if key not in _ANSWERS:
        _ANSWERS[key] = create(client, tool_choice=tool_choice).choices[0]
    return _ANSWERS[key]


def calls_of(choice: Any) -> list[tuple[str, Any]]:
    """(name, arguments) of each call, after checking its shape and validating its arguments."""
    out = []
    for call in choice.message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def streamed(client: openai.OpenAI, **kw: Any) -> dict[str, Any]:
    """A stream's deltas put back together: role, content, calls by index (with their ids), finish, usage."""
    stream = create(client, stream=True, stream_options={"include_usage": True}, **kw)
    out: dict[str, Any] = {"role": None, "content": "", "calls": {}, "finish": None, "usage": None}
    out["heads"] = 0
    for chunk in stream:
        out["usage"] = chunk.usage or out["usage"]
        for choice in chunk.choices:
            out["role"] = out["role"] or choice.delta.role
            out["content"] += choice.delta.content or ""
            out["finish"] = choice.finish_reason or out["finish"]
            for d in choice.delta.tool_calls or []:
                call = out["calls"].setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                if d.id:
                    assert call["id"] is None and d.type == "function"  # id, type, name: once per call
                    call["id"], call["name"], out["heads"] = d.id, d.function.name, out["heads"] + 1
                call["arguments"] += d.function.arguments or ""
    return out


def test_required_calls_a_listed_function_with_valid_arguments(client: openai.OpenAI) -> None:
    choice = answer(client, "required")
    [(name, arguments)] = calls_of(choice)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert name == "get_weather" and arguments["city"] == "Paris"


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is 12 times 7?"}]
    # room for the call's head and the longest expression the schema allows (40 characters, and
    # SmolLM2 writes each digit as its own token), so the call is whole whatever the model writes
    choice = create(client, ask, tool_choice=NAMED, max_tokens=80).choices[0]
    [(name, _)] = calls_of(choice)
    assert name == "calculate" and choice.finish_reason == "tool_calls"


def test_parallel_tool_calls_false_gives_one_call(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Weather in Paris and in Rome, and what is 3+4?"}]
    choice = create(client, ask, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert len(calls_of(choice)) == 1 and choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("tool_choice", ["required", NAMED, "auto"])
def test_a_stream_carries_the_same_answer_in_openai_chunks(client: openai.OpenAI, tool_choice: Any) -> None:
    choice = answer(client, tool_choice)
    s = streamed(client, tool_choice=tool_choice)
    assert s["role"] == "assistant" and s["finish"] == choice.finish_reason and s["usage"] is not None
    calls = [(c["name"], json.loads(c["arguments"])) for c in s["calls"].values()]
    assert calls == calls_of(choice) and s["heads"] == len(calls)
    assert s["content"] == (choice.message.content or "")
    if calls:  # fresh ids per answer
        first_id = s["calls"][0]["id"]
        assert first_id.startswith("call_") and first_id != choice.message.tool_calls[0].id


def test_auto_answers_text_or_valid_calls(client: openai.OpenAI) -> None:
    """The grammar allows either; whichever the model picks is well formed."""
    for ask in (ASK, [{"role": "user", "content": "Say hello to Anna."}]):
        choice = answer(client, "auto") if ask is ASK else create(client, ask, tool_choice="auto").choices[0]
        if choice.message.tool_calls:
            assert calls_of(choice) and choice.finish_reason == "tool_calls"
            assert choice.message.content is None
        else:
            assert choice.message.content and not choice.message.content.startswith("<")
            assert choice.finish_reason in ("stop", "length")


def test_tool_choice_none_is_the_plain_answer(client: openai.OpenAI) -> None:
    """none: the tools are not even rendered, so the answer is the one without tools, streamed too."""
    plain = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24)
    choice = create(client, tool_choice="none", max_tokens=24).choices[0]
    assert choice.message.tool_calls is None and choice.message.content == plain.choices[0].message.content
    s = streamed(client, tool_choice="none", max_tokens=24)
    assert s["content"] == choice.message.content and not s["calls"] and s["finish"] == choice.finish_reason


def test_a_tool_result_turn_is_answered(client: openai.OpenAI) -> None:
    call = answer(client, "required").message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}, result]
    reply = create(client, turn, tool_choice="none", max_tokens=24)
    assert reply.choices[0].message.content and reply.usage.prompt_tokens > 40
    # the result is in the prompt: another result is another prompt, so another answer's usage
    other = [*turn[:2], {**turn[2], "content": '{"temperature": -5, "sky": "heavy snow and strong wind"}'}]
    longer = create(client, other, tool_choice="none", max_tokens=2)
    assert longer.usage.prompt_tokens > reply.usage.prompt_tokens


BAD_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
    "type": "string", "format": "no-such-format"}}}  # fmt: skip


def error_of(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


def fn(name: str = "f", parameters: Any = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [fn(parameters={"type": "wizard"})]}, "tools[0].function.parameters"),
        ({"tools": [fn(parameters={"properties": {"a": {"type": 5}}})]}, "tools[0].function.parameters"),
        ({"tools": [fn(), fn("g", parameters="a string")]}, "tools[1].function.parameters"),
        ({"tools": [fn("get weather")]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [fn(), fn()]}, "tools"),
        ({"tools": []}, "tools"),
        ({"tools": [fn()], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tools": [fn()], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [fn()], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        # a bad schema beside tools is named as such, even where only calls may come
        ({"tools": [fn()], "tool_choice": "required", "response_format": BAD_FORMAT}, "response_format"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_a_400_naming_the_param(shared_backend_url: str, extra: dict, param: str) -> None:
    body = {"messages": ASK, "max_tokens": 2, **extra}
    resp = httpx.post(f"{shared_backend_url}/chat/completions", json=body, timeout=600)
    assert error_of(resp)["param"] == param


def test_n_samples_each_call_on_their_own_index_in_json_and_stream(client: openai.OpenAI) -> None:
    """n = 2 with a forced call: every choice is a valid call in JSON, and a stream keeps each
    choice's deltas on its own index."""
    kw: dict[str, Any] = {"tool_choice": "required", "n": 2, "seed": 7}
    whole = create(client, **kw)
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert len(calls_of(choice)) == 1 and choice.finish_reason == "tool_calls"
    stream = create(client, stream=True, **kw)
    calls: dict[int, dict[str, str]] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(choice.index, {"name": "", "arguments": ""})
                call["name"] += (d.function.name or "") if d.id else ""
                call["arguments"] += d.function.arguments or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for c in whole.choices:
        [(name, arguments)] = calls_of(c)
        assert calls[c.index]["name"] == name and json.loads(calls[c.index]["arguments"]) == arguments


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
ANSWER_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "weather", "schema": ANSWER_SCHEMA, "strict": True},
}


@pytest.mark.parametrize("tool_choice", ["auto", "required", NAMED, "none"])
def test_tools_with_a_response_format(client: openai.OpenAI, tool_choice: Any) -> None:
    """As OpenAI: ``auto`` answers with calls or with JSON valid against the schema (the grammar is the
    union), ``required``/named with calls, ``none`` with the schema's JSON; in JSON and in a stream."""
    choice = create(client, tool_choice=tool_choice, response_format=ANSWER_FORMAT, max_tokens=40).choices[0]
    calls = calls_of(choice)
    if tool_choice == "none":
        assert not calls
    if tool_choice in ("required", NAMED):
        assert calls and choice.finish_reason == "tool_calls"
    if not calls:
        jsonschema.validate(json.loads(choice.message.content), ANSWER_SCHEMA)
        assert choice.finish_reason == "stop"
    if tool_choice == "auto":  # the same answer streamed (greedy)
        s = streamed(client, tool_choice=tool_choice, response_format=ANSWER_FORMAT, max_tokens=40)
        assert s["content"] == (choice.message.content or "") and s["finish"] == choice.finish_reason
        assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"].values()] == calls
