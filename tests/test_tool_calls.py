"""Tool calls through the cache: stored when whole, replayed under fresh ids as JSON and as OpenAI-shaped
streams, and the tool-result turn that follows hits only when it repeats exactly.

The real gateway on real SQLite, driven by the real openai SDK. Most tests put the small
OpenAI-compatible test server in tests/tool_server.py behind it: it answers with labelled calls whose
arguments come from the question and streams them in several pieces, so the gateway's reassembly is
exercised as well as its replay (the embedded 135M model's calls are valid but not predictable
enough for that). The last tests put the built-in engine (the session's shared one) behind it.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from testkit.servers import serve_in_thread
from tests.test_admin import admin_settings, api
from tests.test_gateway import gateway
from tests.tool_server import Calls, tool_backend, weather_tool

TOOLS = [weather_tool()]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def backend() -> Iterator[tuple[str, Calls]]:
    calls = Calls()
    with serve_in_thread(tool_backend(calls)) as url:
        yield f"{url}/v1", calls


@pytest.fixture(scope="module")
def gw(backend: tuple[str, Calls], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    data_dir = tmp_path_factory.mktemp("tools")
    with gateway(admin_settings(data_dir, backend[0])) as url:
        yield url, data_dir


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="tenant-a", max_retries=0, timeout=60)


def ask(url: str, messages: list[dict], model: str = "tools", **kw: Any) -> tuple[Any, dict[str, str]]:
    """(the parsed ChatCompletion, the response headers) of a JSON request."""
    raw = client(url).chat.completions.with_raw_response.create(
        model=model, messages=messages, temperature=0, **kw
    )
    return raw.parse(), dict(raw.headers)


def calls_of(completion: Any) -> list[tuple[str, str, str]]:
    return [(c.id, c.function.name, c.function.arguments) for c in completion.choices[0].message.tool_calls]


def test_an_identical_tool_request_is_an_exact_hit_with_fresh_call_ids(gw, backend) -> None:
    url, _ = gw
    before = len(backend[1])
    first, h1 = ask(url, ASK, tools=TOOLS)
    again, h2 = ask(url, ASK, tools=TOOLS)
    assert (h1["x-cache"], h2["x-cache"], h2["x-cache-reason"]) == ("miss", "exact-hit", "exact")
    assert len(backend[1]) == before + 1  # the second came from the cache
    [(id1, name1, args1)], [(id2, name2, args2)] = calls_of(first), calls_of(again)
    assert (name2, json.loads(args2)) == (name1, {"city": "Paris", "unit": "celsius"}) and args2 == args1
    assert id2 != id1 and id2.startswith("call_") and len(id2) == len("call_") + 24
    assert again.choices[0].finish_reason == "tool_calls" and again.choices[0].message.content is None
    third, _ = ask(url, ASK, tools=TOOLS)
    assert calls_of(third)[0][0] not in (id1, id2)  # every replay gets its own id


def test_a_streamed_tool_call_is_stored_and_replayed_as_a_stream_and_as_json(gw, backend) -> None:
    url, _ = gw
    messages = [{"role": "user", "content": "What is the weather in Lisbon?"}]
    before = len(backend[1])

    def raw_stream() -> tuple[dict[int, dict[str, str]], str | None, dict | None, str]:
        """Iterate the SDK's chunks and put the calls back together by index."""
        raw = client(url).chat.completions.with_raw_response.create(
            model="tools",
            messages=messages,
            tools=TOOLS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        calls: dict[int, dict[str, str]] = {}
        finish = usage = None
        first_delta = None
        for chunk in raw.parse():
            if chunk.usage:
                usage = chunk.usage.model_dump()
            for choice in chunk.choices:
                first_delta = first_delta or choice.delta
                for d in choice.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] += d.id or ""
                    call["name"] += (d.function.name or "") if d.function else ""
                    call["arguments"] += (d.function.arguments or "") if d.function else ""
                finish = choice.finish_reason or finish
        assert first_delta is not None and first_delta.role == "assistant"
        return calls, finish, usage, raw.headers["x-cache"]

    miss, finish1, usage1, cache1 = raw_stream()
    hit, finish2, usage2, cache2 = raw_stream()
    assert (cache1, cache2) == ("miss", "exact-hit") and len(backend[1]) == before + 1
    assert finish1 == finish2 == "tool_calls" and usage1 == usage2 is not None
    assert [(c["name"], c["arguments"]) for c in hit.values()] == [
        (c["name"], c["arguments"]) for c in miss.values()
    ]
    assert json.loads(hit[0]["arguments"]) == {"city": "Lisbon", "unit": "celsius"}
    assert hit[0]["id"] != miss[0]["id"] and hit[0]["id"].startswith("call_")
    # the SDK's own stream helper accumulates the replayed deltas into the same call
    with client(url).chat.completions.stream(
        model="tools", messages=messages, tools=TOOLS, temperature=0
    ) as s:
        final = s.get_final_completion()
    [(helper_id, name, arguments)] = calls_of(final)
    assert (name, arguments) == (miss[0]["name"], miss[0]["arguments"]) and helper_id not in (
        hit[0]["id"],
        miss[0]["id"],
    )
    # stored from a stream, served as JSON
    as_json, h = ask(url, messages, tools=TOOLS)
    assert h["x-cache"] == "exact-hit" and calls_of(as_json)[0][1:] == (name, arguments)
    assert len(backend[1]) == before + 1


def test_a_backend_that_ends_tool_calls_with_stop_is_cached_too(gw, backend) -> None:
    url, _ = gw
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first, h1 = ask(url, messages, model="tools-stop", tools=TOOLS)
    again, h2 = ask(url, messages, model="tools-stop", tools=TOOLS)
    assert (h1["x-cache"], h2["x-cache"]) == ("miss", "exact-hit")
    assert again.choices[0].finish_reason == "stop"  # replayed as the backend said it
    assert calls_of(again)[0][1:] == calls_of(first)[0][1:] and calls_of(again)[0][0] != calls_of(first)[0][0]


def test_vllm_empty_tool_calls_field_does_not_stop_a_text_answer_being_stored(gw) -> None:
    """vLLM sends ``tool_calls: []`` and ``reasoning_content: null`` with every text answer; the old
    rule read any non-null extra field as a tool call and stored none of them."""
    url, _ = gw
    messages = [{"role": "user", "content": "Say something about vLLM."}]
    first, h1 = ask(url, messages, model="tools-vllm")
    again, h2 = ask(url, messages, model="tools-vllm")
    assert (h1["x-cache"], h2["x-cache"]) == ("miss", "exact-hit")
    assert again.choices[0].message.content == first.choices[0].message.content


def follow_up(call_id: str, user: str = "What is the weather in Paris?") -> list[dict]:
    """The conversation after the client ran the call: the call, then its result."""
    return [
        {"role": "user", "content": user},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]


def test_a_repeated_tool_result_turn_hits_exactly_and_a_paraphrase_does_not(gw, backend) -> None:
    """The follow-up carries the call id the client was given; a replayed call has a fresh one, so the
    repeat differs in that id only and must still be exact."""
    url, _ = gw
    ask_call, _ = ask(url, ASK, tools=TOOLS)
    before = len(backend[1])
    answer, h1 = ask(url, follow_up(calls_of(ask_call)[0][0]), tools=TOOLS)
    replayed, hr = ask(url, ASK, tools=TOOLS)
    assert hr["x-cache"] == "exact-hit"
    again, h2 = ask(url, follow_up(calls_of(replayed)[0][0]), tools=TOOLS)
    assert (h1["x-cache"], h2["x-cache"], h2["x-cache-reason"]) == ("miss", "exact-hit", "exact")
    assert again.choices[0].message.content == answer.choices[0].message.content
    assert len(backend[1]) == before + 1
    # the same turn after a paraphrased question: the exact tier only, so the backend answers
    para, hp = ask(url, follow_up("call_other", user="How is the weather in Paris today?"), tools=TOOLS)
    assert (hp["x-cache"], hp["x-cache-reason"]) == ("miss", "exact-only")
    assert para.choices[0].message.content != answer.choices[0].message.content
    # and a tool call is never a semantic hit: a paraphrase of the question asks the backend again
    _, hq = ask(url, [{"role": "user", "content": "What's the weather like in Paris?"}], tools=TOOLS)
    assert hq["x-cache"] == "miss" and len(backend[1]) == before + 3


def schema(*fields: str) -> dict[str, Any]:
    properties = {f: {"type": "string"} for f in fields}
    body = {"type": "object", "properties": properties, "required": list(fields)}
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": body}}


def test_a_structured_answer_hits_only_under_the_same_schema(gw) -> None:
    url, _ = gw
    messages = [{"role": "user", "content": "Describe Madrid as JSON."}]
    first, h1 = ask(url, messages, response_format=schema("city", "country"))
    again, h2 = ask(url, messages, response_format=schema("city", "country"))
    assert (h1["x-cache"], h2["x-cache"]) == ("miss", "exact-hit")
    assert again.choices[0].message.content == first.choices[0].message.content
    # the same fields generated in another order is another answer
    _, h3 = ask(url, messages, response_format=schema("country", "city"))
    _, h4 = ask(url, messages, response_format={"type": "json_object"})
    assert (h3["x-cache"], h4["x-cache"]) == ("miss", "miss")


def test_other_tools_or_tool_choice_are_a_miss(gw, backend) -> None:
    url, _ = gw
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    ask(url, messages, tools=TOOLS)
    _, h = ask(url, messages, tools=[weather_tool("weather_now")])
    assert h["x-cache"] == "miss"
    forced = {"type": "function", "function": {"name": "get_weather"}}
    _, h = ask(url, messages, tools=TOOLS, tool_choice=forced)
    assert h["x-cache"] == "miss"
    _, h = ask(url, messages, tools=TOOLS, parallel_tool_calls=False)
    assert h["x-cache"] == "miss"


def test_tool_call_entries_have_no_embedding_and_show_their_calls(gw) -> None:
    """Exact repeats only: a stored call never enters the vector index. The dashboard's entry list
    shows the call (it showed an empty answer)."""
    url, data_dir = gw
    answers = [e["answer"] for e in api(url, "GET", "/entries", params={"limit": 100}).json()["data"]]
    assert 'get_weather({"city": "Paris", "unit": "celsius"})' in answers
    with sqlite3.connect(data_dir / "cachegw.db") as db:
        rows = db.execute("SELECT response, embedding, scope FROM cache_entries").fetchall()
    with_calls = [(e, s) for r, e, s in rows if json.loads(r)["choices"][0]["message"].get("tool_calls")]
    assert with_calls and all(e is None and s == "" for e, s in with_calls)


# --- the same through the built-in engine: its own tool calls and structured answers, cached -------

ENGINE_MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def engine_gw(shared_backend_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real gateway in front of the session's built-in engine (its generic tool prompt and grammar)."""
    with gateway(admin_settings(tmp_path_factory.mktemp("engine-tools"), shared_backend_url)) as url:
        yield url


def test_engine_tool_calls_are_cached_and_replayed_with_fresh_ids(engine_gw: str) -> None:
    messages = [{"role": "user", "content": "What is the weather in Madrid?"}]
    kw: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 40}
    first, h1 = ask(engine_gw, messages, model=ENGINE_MODEL, **kw)
    again, h2 = ask(engine_gw, messages, model=ENGINE_MODEL, **kw)
    assert (h1["x-cache"], h2["x-cache"], h2["x-cache-reason"]) == ("miss", "exact-hit", "exact")
    [(id1, name1, args1)], [(id2, name2, args2)] = calls_of(first), calls_of(again)
    assert (name2, args2) == (name1, args1) and name1 == "get_weather" and json.loads(args1)["city"]
    assert id1.startswith("call_") and id2.startswith("call_") and id2 != id1
    assert again.choices[0].finish_reason == "tool_calls" and again.choices[0].message.content is None
    # stored from JSON, replayed as a stream with yet another id
    with client(engine_gw).chat.completions.stream(
        model=ENGINE_MODEL, messages=messages, temperature=0, **kw
    ) as s:
        final = s.get_final_completion()
    [(id3, name3, args3)] = calls_of(final)
    assert (name3, args3) == (name1, args1) and id3 not in (id1, id2)


def test_engine_json_schema_answers_are_cached(engine_gw: str) -> None:
    fmt = schema("city", "country")
    fmt["json_schema"]["schema"]["properties"] = {"city": {"type": "string", "maxLength": 16},
                                                  "country": {"type": "string", "maxLength": 16}}  # fmt: skip
    messages = [{"role": "user", "content": "Describe Madrid as JSON."}]
    first, h1 = ask(engine_gw, messages, model=ENGINE_MODEL, response_format=fmt, max_tokens=40)
    again, h2 = ask(engine_gw, messages, model=ENGINE_MODEL, response_format=fmt, max_tokens=40)
    assert (h1["x-cache"], h2["x-cache"]) == ("miss", "exact-hit")
    assert again.choices[0].message.content == first.choices[0].message.content
    assert set(json.loads(first.choices[0].message.content)) == {"city", "country"}
