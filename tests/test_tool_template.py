"""Tool calling without weights: prompt rendering, the grammar and the parser, on SmolLM2's tokenizer.

The template path is tested with a Hermes/Qwen-style chat template (tests/tool_templates.py; the
embedded model's own template knows no tools): the engine must see that it renders tools with
``<tool_call>`` blocks, let it render them, constrain the output to that format and read it back, as
JSON and as stream deltas. The generic path is tested on SmolLM2's own template. No model is loaded:
only the tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from cachegw.backend.core.structured import GrammarCompiler
from cachegw.backend.entrypoints.tool_parser import HERMES, scan
from cachegw.backend.entrypoints.tool_prompt import chat_prompt_ids, template_format
from cachegw.backend.entrypoints.tool_responses import ToolDeltas, tool_message
from cachegw.backend.entrypoints.tools import ToolRequest, tool_request
from cachegw.protocol.requests import ChatMessage
from tests.tool_server import weather_tool
from tests.tool_templates import HERMES_STYLE, with_template
from tests.tool_templates import accepts as accepts_ids

CALC = {
    "type": "function",
    "function": {
        "name": "calculate",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}, "precision": {"type": "integer", "minimum": 0}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [weather_tool(), CALC]
TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+2", "precision": 0}}\n</tool_call>'
)
TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]  # fmt: skip


@pytest.fixture(scope="module")
def smol(smol_tokenizer: Any) -> Any:
    return smol_tokenizer


@pytest.fixture(scope="module")
def hermes(smol: Any) -> Any:
    """The same tokenizer with a tools-aware template in Hermes' format."""
    return with_template(smol, HERMES_STYLE)


@pytest.fixture(scope="module")
def compiler(smol: Any) -> GrammarCompiler:
    return GrammarCompiler(smol, len(smol), {smol.eos_token_id})


def messages(raw: list[dict]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


def request(choice: Any = "auto", parallel: bool = True, templated: bool = True) -> ToolRequest:
    req = tool_request({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel})
    assert req is not None
    return replace(req, templated=templated)


def accepts(compiler: GrammarCompiler, tok: Any, req: ToolRequest, text: str) -> bool:
    return accepts_ids(compiler, req, tok.encode(text, add_special_tokens=False))


def test_the_format_is_read_from_the_template(smol: Any, hermes: Any) -> None:
    assert template_format(hermes) is HERMES
    assert template_format(smol) is None  # SmolLM2's ChatML template: the generic prompt


def test_the_template_renders_tools_calls_and_results(hermes: Any) -> None:
    text = hermes.decode(chat_prompt_ids(hermes, messages(TURN), request()))
    assert json.dumps(TOOLS[1], ensure_ascii=False) in text  # the template's own listing
    assert "You can call functions" not in text  # not the generic section
    # the earlier call with its arguments as an object, the result as the template writes it
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")
    # tool_choice none: the template is called without tools
    assert "<tools>" not in hermes.decode(chat_prompt_ids(hermes, messages(TURN), request("none")))


def test_the_generic_prompt_lists_the_schemas_and_the_format(smol: Any) -> None:
    req = request("required", templated=False)
    text = smol.decode(chat_prompt_ids(smol, messages(TURN), req))
    assert "You can call functions" in text and json.dumps(TOOLS[1]["function"]["parameters"]) in text
    assert "You must call at least one function." in text
    assert HERMES.call_text("get_weather", '{"city": "Paris"}') in text  # the earlier call, in the format
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    plain = smol.decode(chat_prompt_ids(smol, messages(TURN[:1]), request("none", templated=False)))
    assert "You can call functions" not in plain


def test_parallel_calls_follow_parallel_tool_calls_and_the_template(compiler, smol) -> None:
    assert accepts(compiler, smol, request("required"), TWO_CALLS)
    assert not accepts(compiler, smol, request("required", parallel=False), TWO_CALLS)
    assert not accepts(compiler, smol, request("required", templated=False), TWO_CALLS)  # generic: one
    one = TWO_CALLS.split("\n<tool_call>")[0]
    assert accepts(compiler, smol, request("required", parallel=False), one)


def test_the_grammar_enforces_names_arguments_and_the_choice(compiler, smol) -> None:
    bad_args = HERMES.call_text("calculate", '{"expression": "1", "extra": 1}')
    unknown = HERMES.call_text("launch", "{}")
    assert not accepts(compiler, smol, request("required"), bad_args)
    assert not accepts(compiler, smol, request("required"), unknown)
    assert not accepts(compiler, smol, request("required"), "The weather is fine.")
    assert accepts(compiler, smol, request("auto"), "The weather is fine.")
    named = request({"type": "function", "function": {"name": "calculate"}})
    assert not accepts(compiler, smol, named, TWO_CALLS.split("\n<tool_call>")[0])
    assert accepts(compiler, smol, named, "<tool_call>" + TWO_CALLS.split("<tool_call>")[2])


def test_calls_parse_into_openai_tool_calls(smol: Any) -> None:
    message, finish = tool_message(TWO_CALLS, "stop", HERMES)
    assert finish == "tool_calls" and message["content"] is None
    calls = message["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("calculate", {"expression": "2+2", "precision": 0})
    ]  # fmt: skip
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    # cut by max_tokens inside the second call: the calls so far, finish_reason length
    message, finish = tool_message(TWO_CALLS[:-30], "length", HERMES)
    assert finish == "length" and len(message["tool_calls"]) == 2
    assert tool_message("Hello <tool_call>", "stop", HERMES)[0]["content"] == "Hello <tool_call>"


def test_stream_deltas_rebuild_the_same_calls(smol: Any) -> None:
    """Fed the text as a model writes it, token by token: each call's id, type and name once, as soon as
    the name is out, then argument pieces that add up to the arguments, never a piece of the tag."""
    deltas, text, out = ToolDeltas(HERMES), "", []
    ids = smol.encode(TWO_CALLS, add_special_tokens=False)
    for i in range(len(ids)):
        text = smol.decode(ids[: i + 1])
        out += deltas.feed(text, finished=i == len(ids) - 1)
    calls: dict[int, dict[str, str]] = {}
    for delta in out:
        [d] = delta["tool_calls"]
        call = calls.setdefault(d["index"], {"name": "", "arguments": "", "heads": ""})
        if "id" in d:
            call["heads"] += "x"
            call["name"] = d["function"]["name"]
            assert d["type"] == "function" and d["id"].startswith("call_")
        call["arguments"] += d["function"]["arguments"]
    assert [(c["name"], c["arguments"], c["heads"]) for c in calls.values()] == [
        ("get_weather", '{"city": "Paris"}', "x"), ("calculate", '{"expression": "2+2", "precision": 0}', "x")
    ]  # fmt: skip
    text_deltas = ToolDeltas(HERMES)
    assert text_deltas.feed("Hi", False) == [{"content": "Hi"}]
    assert text_deltas.feed("Hi there", True) == [{"content": " there"}]


def test_partial_outputs_are_read_as_far_as_they_go() -> None:
    assert scan("").kind == "undecided" and scan("<tool").kind == "undecided"
    assert scan("<b>bold</b>").kind == "text" and scan("Sure").kind == "text"
    head = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    [partial] = scan(head).calls
    assert (partial.name, partial.arguments, partial.complete) == ("get_weather", '{"city": "Pa', False)
    # the arguments are read as JSON: whole once their object closes, the call once its tag does
    [held] = scan(head + 'ris"}').calls
    assert held.arguments == '{"city": "Paris"}' and not held.complete
    [whole] = scan(head + 'ris"}}\n</tool_call>').calls
    assert whole.arguments == '{"city": "Paris"}' and whole.complete
