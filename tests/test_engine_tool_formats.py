"""Llama 3.1's and Mistral's tool formats end to end: the real SmolLM2 engine (the session's shared one)
behind a second HTTP server of its own whose tokenizer copy carries a test template in that format
(tests/tool_templates.py), and the real openai SDK. The 135M model was never trained on these
formats; the grammar makes it write them, and the server must render the prompt with the template,
read the calls back, and take Mistral's 9-character ids (or a gateway's ``call_`` ids) on the next turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from testkit.servers import serve_in_thread
from tests.test_engine_tools import ASK, MODEL, SCHEMAS, TOOLS, streamed
from tests.tool_templates import LLAMA3_STYLE, MISTRAL_STYLE


def serve_with_template(engine: Any, template: str) -> Iterator[openai.OpenAI]:
    from cachegw.backend.entrypoints.server import build_app

    app = build_app(engine, MODEL, 1 << 20)
    app.state.server.tokenizer.chat_template = template  # the server's own copy: the engine's is untouched
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def llama(shared_engine: Any) -> Iterator[openai.OpenAI]:
    yield from serve_with_template(shared_engine, LLAMA3_STYLE)


@pytest.fixture(scope="module")
def mistral(shared_engine: Any) -> Iterator[openai.OpenAI]:
    yield from serve_with_template(shared_engine, MISTRAL_STYLE)


def create(client: openai.OpenAI, messages: list[dict] = ASK, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=kw.pop("max_tokens", 40), **kw
    )


def valid_calls(choice: Any) -> list[tuple[str, str, Any]]:
    """(id, name, arguments) of each call, arguments validated against the function's schema."""
    out = []
    for call in choice.message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.id, call.function.name, arguments))
    return out


WEATHER = {"type": "function", "function": {"name": "get_weather"}}  # short arguments: few tokens


def template_prompt_tokens(tokenizer: Any, template: str) -> int:
    """The prompt's length when the template itself renders ASK with the tools (not the generic prompt)."""
    tools = [{"type": "function", "function": {"name": t["function"]["name"], "parameters": t["function"][
        "parameters"], "description": t["function"]["description"]}} for t in TOOLS]  # fmt: skip
    ids = tokenizer.apply_chat_template(
        ASK, tools=tools, chat_template=template, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return len(ids)


def test_llama_format_calls_in_json_and_in_a_stream(llama: openai.OpenAI, smol_tokenizer: Any) -> None:
    reply = create(llama, tool_choice=WEATHER)
    assert reply.usage.prompt_tokens == template_prompt_tokens(smol_tokenizer, LLAMA3_STYLE)
    choice = reply.choices[0]
    [(call_id, name, arguments)] = valid_calls(choice)  # Llama's format: one call per answer
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call_id.startswith("call_") and name == "get_weather"
    s = streamed(llama, tool_choice=WEATHER, max_tokens=40)
    assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"].values()] == [(name, arguments)]
    assert s["finish"] == "tool_calls" and s["heads"] == 1 and s["content"] == ""


def test_mistral_format_ids_come_back_on_the_next_turn(mistral: openai.OpenAI) -> None:
    choice = create(mistral, tool_choice="required").choices[0]
    calls = valid_calls(choice)
    assert calls and choice.finish_reason == "tool_calls"
    assert all(len(i) == 9 and i.isalnum() for i, _, _ in calls)  # what Mistral's template takes back
    call = choice.message.tool_calls[0]
    for call_id in (call.id, "call_0123456789abcdef01234567"):  # as answered; as a gateway replays it
        turn = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [{**call.model_dump(), "id": call_id}]},
            {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21}'},
        ]
        reply = create(mistral, turn, tool_choice="none", max_tokens=4)
        assert reply.choices[0].message.content is not None and reply.usage.prompt_tokens > 40
