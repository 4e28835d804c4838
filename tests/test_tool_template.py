"""Tool calling without weights: prompt rendering, the grammar and the parser, on SmolLM2's tokenizer.

The template path is tested with a Hermes/Qwen-style chat template written here (the embedded model's
own template knows no tools): the engine must see that it renders tools with ``<tool_call>`` blocks,
let it render them, constrain the output to that format and read it back, as JSON and as stream
deltas. The generic path is tested on SmolLM2's own template. No model is loaded: only the tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from backend.sampling_params import StructuredOutput
from backend.structured import Grammar, GrammarCompiler
from backend.tool_parser import HERMES, scan
from backend.tool_prompt import chat_prompt_ids, template_format
from backend.tool_responses import ToolDeltas, tool_message
from backend.tools import ToolRequest, tool_request
from protocol.requests import ChatMessage
from tests.tool_server import weather_tool

HERMES_STYLE_TEMPLATE = """
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are helpful.{% endif %}
Functions you may call, inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each call, answer with <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{% if not tools %}<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
{%- elif message.role == 'assistant' -%}
<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""

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
def smol() -> Any:
    """SmolLM2's tokenizer, with its own chat template (which knows no tools)."""
    from transformers import AutoTokenizer

    from backend.config import load_engine_config
    from backend.model_loader import resolve_model_dir

    cfg = load_engine_config(None)
    return AutoTokenizer.from_pretrained(str(resolve_model_dir(cfg.model, cfg.resolved_cache_dir)))


@pytest.fixture(scope="module")
def hermes(smol: Any) -> Any:
    """The same tokenizer with a tools-aware template in Hermes' format."""
    import copy

    tok = copy.deepcopy(smol)
    tok.chat_template = HERMES_STYLE_TEMPLATE
    return tok


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
    """Whether the grammar of ``req`` lets the model write ``text`` and stop there."""
    spec = req.grammar()
    assert isinstance(spec, StructuredOutput)
    grammar: Grammar = compiler.grammar(spec)
    ids = tok.encode(text, add_special_tokens=False)
    matcher = grammar._matcher
    if matcher.validate_tokens(ids) != len(ids):
        return False
    assert matcher.consume_tokens(ids)
    return bool(matcher.is_accepting())


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
    # the closing brace that may belong to the tag is held back until it is known
    [held] = scan(head + 'ris"}').calls
    assert held.arguments == '{"city": "Paris"' and not held.complete
    [whole] = scan(head + 'ris"}}\n</tool_call>').calls
    assert whole.arguments == '{"city": "Paris"}' and whole.complete
