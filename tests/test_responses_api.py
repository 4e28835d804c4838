"""The Responses API through the gateway, with the real openai SDK in front and the built-in engine
behind: one cache shared with chat completions, streams with the SDK's typed events, stored responses
(previous_response_id, GET, DELETE), tool turns, and errors in OpenAI's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.test_gateway import MODEL, backend_url, client, gateway, settings_for  # noqa: F401

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def gw(backend_url, tmp_path_factory) -> Iterator[str]:  # noqa: F811
    with gateway(settings_for(tmp_path_factory.mktemp("responses"), [backend_url])) as url:
        yield url


def create(url: str, key: str = "tenant-a", **kw):
    """(Response, headers) of a non-stream Response."""
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 40)
    raw = client(url, key).responses.with_raw_response.create(model=MODEL, **kw)
    return raw.parse(), dict(raw.headers)


def test_a_question_asked_by_chat_then_as_a_response_is_a_hit(gw):
    question = "What is the capital of France?"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    raw = client(gw).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=40
    )
    assert raw.headers["x-cache"] == "miss"
    chat_text = raw.parse().choices[0].message.content
    response, headers = create(gw, instructions=SYSTEM, input=question)
    assert headers["x-cache"] == "exact-hit"
    assert response.output_text == chat_text and response.status == "completed"
    assert response.id.startswith("resp_") and response.output[0].type == "message"
    assert response.usage is not None and response.usage.output_tokens > 0


def test_a_response_then_the_same_as_chat_is_a_hit_and_items_match_a_string(gw):
    question = "Name a large ocean."
    first, h1 = create(gw, instructions=SYSTEM, input=question)
    assert h1["x-cache"] == "miss" and first.output_text
    # the same question as a list of input items: one text part is the same message
    items = [{"role": "user", "content": [{"type": "input_text", "text": question}]}]
    again, h2 = create(gw, instructions=SYSTEM, input=items)
    assert h2["x-cache"] == "exact-hit" and again.output_text == first.output_text and again.id != first.id
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    raw = client(gw).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=40
    )
    assert (
        raw.headers["x-cache"] == "exact-hit" and raw.parse().choices[0].message.content == first.output_text
    )


def test_stream_miss_then_hit_replayed_as_typed_events(gw):
    c = client(gw)

    def stream() -> tuple[str, list[str], object]:
        with c.responses.stream(
            model=MODEL,
            instructions=SYSTEM,
            input="Name a primary color.",
            temperature=0,
            max_output_tokens=40,
        ) as s:
            kinds, text = [], ""
            for event in s:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    text += event.delta
            return text, kinds, s.get_final_response()

    text1, kinds1, final1 = stream()
    text2, kinds2, final2 = stream()
    for kinds in (kinds1, kinds2):
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed"
        assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert text1 and text1 == text2 == final1.output_text == final2.output_text
    assert final1.id != final2.id and final1.usage.output_tokens > 0


def test_a_cut_answer_is_incomplete(gw):
    response, _ = create(gw, input="Write a long story about a dragon.", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    with client(gw).responses.stream(
        model=MODEL, input="Write a long story about a knight.", temperature=0, max_output_tokens=3
    ) as s:
        kinds = [e.type for e in s]
    assert kinds[-1] == "response.incomplete"


def test_previous_response_id_goes_on_from_a_stored_response(gw):
    first, _ = create(gw, instructions=SYSTEM, input="My name is Ada. Say hello to me.")
    second, _ = create(gw, instructions=SYSTEM, input="What is my name?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # the backend was asked the whole conversation: as chat, the same turns are the same request
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "My name is Ada. Say hello to me."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    raw = client(gw).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=40
    )
    assert (
        raw.headers["x-cache"] == "exact-hit" and raw.parse().choices[0].message.content == second.output_text
    )
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    fetched = client(gw).responses.retrieve(second.id)
    assert fetched.output_text == second.output_text and fetched.id == second.id


def test_get_and_delete_are_per_tenant(gw):
    response, _ = create(gw, input="Say one word.")
    with pytest.raises(openai.NotFoundError):
        client(gw, "tenant-b").responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client(gw, "tenant-b").responses.delete(response.id)
    client(gw).responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client(gw).responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):  # gone for good: nothing to go on from
        create(gw, input="And again?", previous_response_id=response.id)


def test_store_false_keeps_nothing(gw):
    response, _ = create(gw, input="Say two words.", store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client(gw).responses.retrieve(response.id)


def test_a_tool_turn_as_function_call_items(gw):
    c = client(gw)
    first = c.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=60,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].id.startswith("fc_")
    assert "city" in json.loads(calls[0].arguments)
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"}
    second = c.responses.create(
        model=MODEL,
        input=[result],
        previous_response_id=first.id,
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=40,
    )
    # the model may answer or call again; either way it was asked with the call and its result
    assert second.status == "completed" and second.output
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_json_schema_text_format(gw):
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string"}},
        "required": ["color"],
        "additionalProperties": False,
    }
    response, _ = create(
        gw,
        input="Name a color.",
        text={"format": {"type": "json_schema", "name": "color", "schema": schema, "strict": True}},
        max_output_tokens=40,
    )
    assert isinstance(json.loads(response.output_text)["color"], str)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"model": MODEL, "input": "hi", "max_output_tokens": "ten"}, "max_output_tokens"),
        ({"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"model": MODEL, "input": "hi", "background": True}, "background"),
        ({"model": MODEL, "input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ],
)
def test_bad_input_is_an_openai_error_naming_the_field(gw, body, param):
    r = httpx.post(f"{gw}/v1/responses", json=body, headers={"Authorization": "Bearer tenant-a"}, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


def test_unknown_model_is_a_404(gw):
    with pytest.raises(openai.NotFoundError):
        client(gw).responses.create(model="no-such-model", input="hi")


def test_requests_are_counted_by_api(gw):
    create(gw, input="Count me.")
    scrape = httpx.get(f"{gw}/metrics", timeout=30).text
    assert 'cachegw_gateway_api_requests_total{api="responses"' in scrape


def test_an_openai_agents_sdk_agent_runs_a_tool_through_the_gateway(gw):
    """The Agents SDK's default model class speaks the Responses API; its agent loop (the model calls
    the tool, the SDK runs it) runs against the gateway and the built-in engine. The agent stops at
    the tool's result: a 135M model asked again tends to call the tool again (sending a result back is
    ``test_a_tool_turn_as_function_call_items``)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # traces would go to OpenAI's servers
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(city)
        return f"Sunny, 24 C in {city}"

    model = agents.OpenAIResponsesModel(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=f"{gw}/v1", api_key="tenant-a", max_retries=0)
    )
    agent = agents.Agent(
        name="weather",
        instructions="Answer weather questions with the get_weather tool.",
        tools=[get_weather],
        model=model,
        model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60),
        tool_use_behavior="stop_on_first_tool",
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert seen, "the agent never called its tool"
    assert result.final_output == f"Sunny, 24 C in {seen[0]}"
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds


def test_litellm_as_a_client_of_the_responses_api(gw, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list
    litellm = pytest.importorskip("litellm")
    kw = {"model": f"openai/{MODEL}", "api_base": f"{gw}/v1", "api_key": "tenant-a", "temperature": 0}
    first = litellm.responses(input="Name a planet.", max_output_tokens=24, **kw)
    again = litellm.responses(input="Name a planet.", max_output_tokens=24, **kw)
    text = lambda r: "".join(p.text for item in r.output if item.type == "message" for p in item.content)  # noqa: E731
    assert text(first) and text(again) == text(first) and again.id != first.id
