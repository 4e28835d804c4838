"""Llama 3.1+'s and Mistral's tool formats, without weights: SmolLM2's tokenizer given a test template
in each format (tests/tool_templates.py), checked as the engine uses it: the format read from the
template, the prompt it renders (tools, an earlier call, its result), the grammar of each
tool_choice, and model output read back into OpenAI tool calls, whole and streamed in pieces cut at
every character. Mistral's ``[TOOL_CALLS]`` is also checked as the special token it is in Mistral's
own tokenizer: the grammar makes the model write that one token, and the text keeps it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from cachegw.backend.core.detokenizer import IncrementalDetokenizer
from cachegw.backend.core.sampling_params import StructuredOutput
from cachegw.backend.core.structured import GrammarCompiler
from cachegw.backend.entrypoints.request_fields import EngineChatRequest
from cachegw.backend.entrypoints.tool_parser import HERMES, LLAMA3, MISTRAL, ToolFormat, scan, whole_calls
from cachegw.backend.entrypoints.tool_prompt import (
    chat_prompt_ids,
    generic_tool_section,
    request_tools,
    template_call_id,
    template_format,
)
from cachegw.backend.entrypoints.tool_responses import ToolDeltas, tool_message
from cachegw.backend.entrypoints.tools import ToolRequest, tool_request
from cachegw.protocol.requests import ChatMessage
from tests.tool_server import weather_tool
from tests.tool_templates import LLAMA3_STYLE, MISTRAL_STYLE, accepts, with_template

CALC = {"type": "function", "function": {"name": "calculate", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"],
    "additionalProperties": False}}}  # fmt: skip
TOOLS = [weather_tool(), CALC]
TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]  # fmt: skip
# what each model writes, with awkward contents: braces and brackets in strings, escaped quotes, unicode
WEATHER_ARGS = '{"city": "Saint-{Denis} [93] \\"north\\"", "unit": "°C"}'
CALC_ARGS = '{"expression": "{[(1+2)]}*3"}'
OUTPUTS = {
    "llama3": f'{{"name": "get_weather", "parameters": {WEATHER_ARGS}}}',
    "llama3-tag": f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER_ARGS}}}',
    "mistral": f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}, '
    f'{{"name": "calculate", "arguments": {CALC_ARGS}}}]',
}
EXPECTED = {
    "llama3": [("get_weather", WEATHER_ARGS)],
    "llama3-tag": [("get_weather", WEATHER_ARGS)],
    "mistral": [("get_weather", WEATHER_ARGS), ("calculate", CALC_ARGS)],
}
FORMATS = {"llama3": LLAMA3, "llama3-tag": LLAMA3, "mistral": MISTRAL}


@pytest.fixture(scope="module")
def llama(smol_tokenizer: Any) -> Any:
    return with_template(smol_tokenizer, LLAMA3_STYLE)


@pytest.fixture(scope="module")
def mistral(smol_tokenizer: Any) -> Any:
    return with_template(smol_tokenizer, MISTRAL_STYLE)


@pytest.fixture(scope="module")
def mistral_special(smol_tokenizer: Any) -> Any:
    """As Mistral's own tokenizer has it: ``[TOOL_CALLS]`` one special token."""
    return with_template(smol_tokenizer, MISTRAL_STYLE, special=("[TOOL_CALLS]",))


@pytest.fixture(scope="module")
def compiler(smol_tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(smol_tokenizer, len(smol_tokenizer), {smol_tokenizer.eos_token_id})


def chat(raw: list[dict], choice: Any = "auto", parallel: bool = True) -> EngineChatRequest:
    body = {
        "model": "m",
        "messages": raw,
        "tools": TOOLS,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
    }
    return EngineChatRequest.model_validate(body)


def tools_for(tok: Any, choice: Any = "auto", parallel: bool = True) -> ToolRequest:
    req = request_tools(chat(TURN, choice, parallel), tok)
    assert req is not None
    return req


def render(tok: Any, choice: Any = "auto", raw: list[dict] = TURN) -> str:
    req = request_tools(chat(raw, choice), tok)
    return tok.decode(chat_prompt_ids(tok, [ChatMessage.model_validate(m) for m in raw], req))


def test_each_format_is_read_from_its_template(llama: Any, mistral: Any, smol_tokenizer: Any) -> None:
    assert template_format(llama) is LLAMA3 and template_format(mistral) is MISTRAL
    assert template_format(smol_tokenizer) is None
    req = tools_for(llama)
    assert req.format is LLAMA3 and req.templated and not req.several_calls  # Llama: one call per answer
    assert tools_for(mistral).several_calls and not tools_for(mistral, parallel=False).several_calls


def test_llama_renders_tools_the_call_and_its_result(llama: Any) -> None:
    text = render(llama)
    assert "Environment: ipython" in text and json.dumps(CALC, ensure_ascii=False) in text
    assert "You can call functions" not in text  # the template's own listing, not the generic prompt
    assert '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": ' \
        '{"city": "Paris"}}<|eot_id|>' in text  # fmt: skip
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"temperature": 21}<|eot_id|>' in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "Environment: ipython" not in render(llama, "none")


def test_mistral_renders_tools_and_maps_call_ids_to_nine_characters(mistral: Any) -> None:
    text = render(mistral)
    short = template_call_id("call_1", MISTRAL)
    assert short is not None and len(short) == 9 and short.isalnum()
    assert (
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{short}"}}]' in text
    )
    assert f'[TOOL_RESULTS] {{"content": "{{\\"temperature\\": 21}}", "call_id": "{short}"}}' in text
    assert text.index("[AVAILABLE_TOOLS]") < text.index("[INST] Weather in Paris?")
    assert template_call_id("a1B2c3D4e", MISTRAL) == "a1B2c3D4e"  # a Mistral id is kept as it is
    assert template_call_id("call_1", HERMES) == "call_1"  # other formats keep any id
    assert "[AVAILABLE_TOOLS]" not in render(mistral, "none")


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_output_parses_into_openai_tool_calls(case: str) -> None:
    fmt = FORMATS[case]
    message, finish = tool_message(OUTPUTS[case], "stop", fmt)
    assert finish == "tool_calls" and message["content"] is None
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls == EXPECTED[case] and all(json.loads(a) for _, a in calls)
    ids = [c["id"] for c in message["tool_calls"]]
    if fmt is MISTRAL:  # the ids Mistral's template takes back on the next turn
        assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == len(ids)
    else:
        assert all(i.startswith("call_") for i in ids)
    # cut by max_tokens: the calls so far, finish_reason length; text stays text
    cut, finish = tool_message(OUTPUTS[case][:-12], "length", fmt)
    assert finish == "length" and cut["tool_calls"][0]["function"]["name"] == "get_weather"
    assert tool_message("Paris is sunny.", "stop", fmt)[0]["content"] == "Paris is sunny."


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_streamed_pieces_cut_anywhere_rebuild_the_calls(case: str) -> None:
    """Every way of cutting the output in two, and one character at a time: the deltas add up to the
    same calls, each call's id, type and name in one delta, never a piece of the format's markup."""
    fmt, text = FORMATS[case], OUTPUTS[case]
    cuts = [[text[:k], text] for k in range(1, len(text))] + [[text[: k + 1] for k in range(len(text))]]
    for pieces in cuts:
        deltas = ToolDeltas(fmt)
        out = [d for i, p in enumerate(pieces) for d in deltas.feed(p, finished=i == len(pieces) - 1)]
        calls: dict[int, list[str]] = {}
        for delta in out:
            [d] = delta["tool_calls"]
            if "id" in d:
                assert d["index"] not in calls and d["type"] == "function"
                calls[d["index"]] = [d["function"]["name"], ""]
            calls[d["index"]][1] += d["function"]["arguments"]
        assert [tuple(c) for c in calls.values()] == EXPECTED[case], pieces[0]


def test_partial_text_waits_until_it_is_known_to_be_text() -> None:
    for fmt, start in ((LLAMA3, '{"na'), (LLAMA3, "<|python_"), (MISTRAL, "[TOOL_CA")):
        assert scan(start, fmt).kind == "undecided"
    assert scan('{"city": "Paris"}', LLAMA3).kind == "text"  # JSON, but not a call
    assert scan("[link](http://x)", MISTRAL).kind == "text"
    assert whole_calls(OUTPUTS["mistral"][:-1], MISTRAL) is None  # the list never closed
    assert whole_calls(OUTPUTS["mistral"] + " more", MISTRAL) is None


def grammar_accepts(compiler: GrammarCompiler, tok: Any, req: ToolRequest, text: str, **kw: Any) -> bool:
    return accepts(compiler, req, tok.encode(text, add_special_tokens=False), **kw)


def test_llama_grammar_writes_one_bare_json_call(compiler: GrammarCompiler, llama: Any) -> None:
    required, auto = tools_for(llama, "required"), tools_for(llama, "auto")
    one = '{"name": "calculate", "parameters": {"expression": "1+1"}}'
    assert grammar_accepts(compiler, llama, required, one)
    assert not grammar_accepts(compiler, llama, required, f"{one}; {one}")  # one call per answer
    assert not grammar_accepts(
        compiler, llama, required, HERMES.call_text("calculate", '{"expression": "1"}')
    )
    assert not grammar_accepts(compiler, llama, required, '{"name": "calculate", "parameters": {"x": 1}}')
    named = tools_for(llama, {"type": "function", "function": {"name": "get_weather"}})
    assert not grammar_accepts(compiler, llama, named, one)
    assert grammar_accepts(compiler, llama, auto, "It is sunny.")
    assert not grammar_accepts(compiler, llama, auto, '{"city": "Paris"}')  # text cannot start a call


def test_mistral_grammar_writes_a_list_of_calls(compiler: GrammarCompiler, mistral: Any) -> None:
    required = tools_for(mistral, "required")
    assert grammar_accepts(compiler, mistral, required, OUTPUTS["mistral"].replace("°", "o"))
    single = '[TOOL_CALLS] [{"name": "calculate", "arguments": {"expression": "2"}}]'
    assert grammar_accepts(compiler, mistral, tools_for(mistral, "required", parallel=False), single)
    assert not grammar_accepts(
        compiler,
        mistral,
        tools_for(mistral, "required", parallel=False),
        OUTPUTS["mistral"].replace("°", "o"),
    )
    assert not grammar_accepts(compiler, mistral, required, single[:-1])  # the list must close
    assert grammar_accepts(compiler, mistral, tools_for(mistral, "auto"), "Sure.")
    assert not grammar_accepts(compiler, mistral, tools_for(mistral, "auto"), "[1, 2]")


def test_mistral_special_token_is_written_and_kept(mistral_special: Any) -> None:
    """With ``[TOOL_CALLS]`` a special token the grammar allows it only as that token (not spelled
    out), and the text the engine decodes for the request keeps it so the reader finds the calls."""
    tok = mistral_special
    req = tools_for(tok, "required", parallel=False)
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert req.special == (("[TOOL_CALLS]", marker),)
    compiler = GrammarCompiler(tok, len(tok), {tok.eos_token_id})
    body = ' [{"name": "calculate", "arguments": {"expression": "2"}}]'
    ids = [marker, *tok.encode(body, add_special_tokens=False)]
    assert accepts(compiler, req, ids)
    spelled = tok.encode("[TOOL_", add_special_tokens=False) + tok.encode(
        "CALLS]" + body, add_special_tokens=False
    )
    assert marker not in spelled and not accepts(compiler, req, spelled)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    for token in ids:
        detok.add(token)
    [call] = whole_calls(detok.text, MISTRAL) or []
    assert (call.name, call.arguments) == ("calculate", '{"expression": "2"}')


def test_tools_with_a_response_format_allow_calls_or_the_schema(
    compiler: GrammarCompiler, llama: Any
) -> None:
    """auto: a call or JSON valid against the schema, nothing else; required: calls only; none: the schema."""
    answer = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    schema = StructuredOutput.json_schema({**answer, "additionalProperties": False}, True)
    call = '{"name": "calculate", "parameters": {"expression": "6*7"}}'
    for fmt_tok in (llama, with_template(llama, "{{ messages }}")):  # Llama's format, and the generic one
        auto = tools_for(fmt_tok, "auto")
        assert grammar_accepts(compiler, fmt_tok, auto, '{"answer": 42}', answer=schema)
        assert not grammar_accepts(compiler, fmt_tok, auto, '{"answer": "42"}', answer=schema)
        assert not grammar_accepts(compiler, fmt_tok, auto, "Forty-two.", answer=schema)
        text = call if auto.format is LLAMA3 else auto.format.call_text("calculate", '{"expression": "6*7"}')
        assert grammar_accepts(compiler, fmt_tok, auto, text, answer=schema)
        assert not grammar_accepts(
            compiler, fmt_tok, tools_for(fmt_tok, "required"), '{"answer": 42}', answer=schema
        )
        assert tools_for(fmt_tok, "none").grammar(schema) is schema
        message, _ = tool_message('{"answer": 42}', "stop", auto.format)
        assert message["content"] == '{"answer": 42}' and "tool_calls" not in message


def test_the_formats_stay_as_declared() -> None:
    """The three layouts written out (what the grammar makes the model write and the reader reads)."""
    assert HERMES.calls_text([("f", "{}")]) == '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert LLAMA3.calls_text([("f", "{}")]) == '{"name": "f", "parameters": {}}'
    assert MISTRAL.calls_text([("f", "{}"), ("g", "{}")]) == (
        '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]'
    )
    assert isinstance(tool_request({"tools": TOOLS}), ToolRequest)
    assert replace(HERMES, name="x") != HERMES and isinstance(HERMES, ToolFormat)


def test_the_generic_prompt_asks_for_the_json_when_a_response_format_does(smol_tokenizer: Any) -> None:
    body = {"model": "m", "messages": TURN[1:2], "tools": TOOLS, "response_format": {"type": "json_object"}}
    req = request_tools(EngineChatRequest.model_validate(body), smol_tokenizer)
    assert req is not None and req.answers_json and not req.templated
    assert "answer with the JSON asked for instead" in generic_tool_section(req)
    assert "answer in plain text instead" in generic_tool_section(replace(req, answers_json=False))
