"""Anthropic's Messages API (``POST /v1/messages``) end to end: the real anthropic SDK against a gateway in
front of the real engine (the session's shared SmolLM2 backend), sharing the cache with chat completions
(the real openai SDK), streams and tool turns included, errors in Anthropic's shape.

The gateway serves requests that leave ``temperature`` unset from the cache here
(``serve_unset_temperature``): the anthropic SDK of this version has no ``temperature`` argument, and the
point is that the same question asked through either API is one cache entry.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import anthropic  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402

from cachegw.gateway.api.messages_api import MessagesStream  # noqa: E402
from cachegw.gateway.request.hits import _PIECE, WORDS_PER_CHUNK  # noqa: E402
from cachegw.protocol import anthropic_answers as aa
from testkit.servers import Upstream, recording_upstream, serve_in_thread  # noqa: E402
from tests.test_gateway import MODEL, backend_url, gateway, settings_for  # noqa: E402, F401

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
SYSTEM_TEXT = "You answer about colours.\n\nBe brief."  # the two system blocks below, as one message


@pytest.fixture(scope="module")
def gw(backend_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # noqa: F811
    s = settings_for(tmp_path_factory.mktemp("msgs"), [backend_url], serve_unset_temperature=True)
    with gateway(s) as url:
        yield url


def claude(url: str, key: str = "tenant-a") -> anthropic.Anthropic:
    """The anthropic SDK pointed at the gateway: it posts to {url}/v1/messages with ``x-api-key``."""
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def create(url: str, key: str = "tenant-a", **kw: Any) -> tuple[Any, dict[str, str]]:
    """(the parsed Message, the response headers)."""
    kw = {"model": MODEL, "max_tokens": 32, **kw}
    raw = claude(url, key).messages.with_raw_response.create(**kw)
    return raw.parse(), dict(raw.headers)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_miss_then_exact_hit_in_anthropic_shape(gw: str) -> None:
    first, h1 = create(gw, messages=user("What is the capital of France?"))
    again, h2 = create(gw, messages=user("What is the capital of France?"))
    assert (h1["x-cache"], h2["x-cache"]) == ("miss", "exact-hit")
    assert first.type == "message" and first.role == "assistant" and first.model == MODEL
    assert first.id.startswith("msg_") and first.id != again.id
    assert h2["request-id"] == h2["x-request-id"] and again.id == "msg_" + h2["x-request-id"][4:]
    assert text_of(first) and text_of(again) == text_of(first)
    assert first.stop_reason in ("end_turn", "max_tokens") and again.stop_reason == first.stop_reason
    assert first.usage.input_tokens > 0 and 0 < first.usage.output_tokens <= 32
    assert first.usage.cache_read_input_tokens is not None
    assert again.usage.output_tokens == first.usage.output_tokens  # a hit reports the stored usage


def test_chat_completions_then_messages_is_one_cache_entry(gw: str) -> None:
    oa = openai.OpenAI(base_url=f"{gw}/v1", api_key="tenant-a", max_retries=0, timeout=120)
    raw = oa.chat.completions.with_raw_response.create(
        model=MODEL, messages=user("Name a primary colour."), max_tokens=32
    )
    chat_text = raw.parse().choices[0].message.content
    message, h = create(gw, messages=user("Name a primary colour."))
    assert raw.headers["x-cache"] == "miss" and h["x-cache"] == "exact-hit"
    assert text_of(message) == chat_text
    # and the other way round
    message, h1 = create(gw, messages=user("Name a large ocean."))
    raw = oa.chat.completions.with_raw_response.create(
        model=MODEL, messages=user("Name a large ocean."), max_tokens=32
    )
    assert h1["x-cache"] == "miss" and raw.headers["x-cache"] == "exact-hit"
    assert raw.parse().choices[0].message.content == text_of(message)


def stream(url: str, **kw: Any) -> tuple[list[str], str, Any, dict[str, str]]:
    """(event types, text from the text events, the final message, headers) of messages.stream."""
    with claude(url).messages.stream(**{"model": MODEL, "max_tokens": 32, **kw}) as s:
        types, text = [], ""
        for event in s:
            types.append(event.type)
            if event.type == "text":
                text += event.text
        return types, text, s.get_final_message(), dict(s.response.headers)


def test_stream_miss_then_a_hit_replayed_as_a_stream(gw: str) -> None:
    types, text, final, h = stream(gw, messages=user("Name a planet of the solar system."))
    assert h["x-cache"] == "miss" and text and text_of(final) == text
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in types and "content_block_stop" in types
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0
    types2, text2, final2, h2 = stream(gw, messages=user("Name a planet of the solar system."))
    assert h2["x-cache"] == "exact-hit" and text2 == text
    # replayed in pieces of a few words, as the chat stream replays it
    assert types2.count("text") == -(-len(_PIECE.findall(text)) // WORDS_PER_CHUNK)
    assert final2.usage.output_tokens == final.usage.output_tokens and final2.stop_reason == final.stop_reason
    # the streamed answer is the JSON answer too
    message, h3 = create(gw, messages=user("Name a planet of the solar system."))
    assert h3["x-cache"] == "exact-hit" and text_of(message) == text


def test_a_tool_turn_and_its_tool_result_turn(gw: str) -> None:
    ask = user("What is the weather in Paris?")
    forced = {"type": "tool", "name": "get_weather"}
    kw: dict[str, Any] = {"tools": [WEATHER], "extra_body": {"temperature": 0}, "max_tokens": 48}
    first, h1 = create(gw, messages=ask, tool_choice=forced, **kw)
    assert h1["x-cache"] == "miss" and first.stop_reason == "tool_use"
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input, dict) and call.id.startswith("toolu_")
    # the same turn as a stream: a hit, its call rebuilt from input_json_delta events under a fresh id
    types, _, streamed, h2 = stream(gw, messages=ask, tool_choice=forced, **kw)
    assert h2["x-cache"] == "exact-hit" and "input_json" in types
    [again] = [b for b in streamed.content if b.type == "tool_use"]
    assert (again.name, again.input) == (call.name, call.input) and again.id != call.id
    assert streamed.stop_reason == "tool_use"
    # the tool's answer goes back as a tool_result; the model answers in text
    turn = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C"}]},
    ]
    answer, h3 = create(gw, messages=turn, tool_choice={"type": "none"}, **kw)
    assert h3["x-cache"] == "miss" and text_of(answer) and answer.stop_reason in ("end_turn", "max_tokens")
    # the follow-up repeats exactly even with the fresh tool_use id of the replayed call
    turn[1] = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in streamed.content]}
    turn[2]["content"][0]["tool_use_id"] = again.id
    repeat, h4 = create(gw, messages=turn, tool_choice={"type": "none"}, **kw)
    assert h4["x-cache"] == "exact-hit" and text_of(repeat) == text_of(answer)


def test_tenants_are_told_apart_by_x_api_key(gw: str) -> None:
    _, h1 = create(gw, key="tenant-a", messages=user("What is the tallest mountain?"))
    _, h2 = create(gw, key="tenant-b", messages=user("What is the tallest mountain?"))
    _, h3 = create(gw, key="tenant-b", messages=user("What is the tallest mountain?"))
    assert (h1["x-cache"], h2["x-cache"], h3["x-cache"]) == ("miss", "miss", "exact-hit")


def anthropic_error(resp: httpx.Response, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


def test_bad_requests_get_anthropic_errors(gw: str) -> None:
    h = {"x-api-key": "tenant-a", "anthropic-version": "2023-06-01"}
    ok = {"model": MODEL, "max_tokens": 8, "messages": user("Hi")}
    block = {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}
    cases = [
        ({k: v for k, v in ok.items() if k != "max_tokens"}, 400, "invalid_request_error", "max_tokens"),
        ({**ok, "messages": [{"role": "system", "content": "Hi"}]}, 400, "invalid_request_error", "role"),
        (
            {**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
            "text only",
        ),
        ({**ok, "system": [block] * 5}, 400, "invalid_request_error", "maximum of 4"),
        ({**ok, "thinking": {"type": "enabled"}}, 400, "invalid_request_error", "thinking"),
        ({**ok, "model": "no-such-model"}, 404, "not_found_error", "no-such-model"),
        ({**ok, "max_tokens": 1_000_000}, 400, "invalid_request_error", ""),  # the engine's own 400
    ]
    with httpx.Client(base_url=gw, timeout=60, headers=h) as http:
        for body, status, kind, says in cases:
            assert says in anthropic_error(http.post("/v1/messages", json=body), status, kind)
        anthropic_error(http.post("/v1/messages", content=b"{not json"), 400, "invalid_request_error")
        metrics = http.get("/metrics").text
    assert 'cachegw_gateway_errors_total{code="invalid_request_error",status="400"}' in metrics
    assert 'cachegw_gateway_api_requests_total{api="messages",result="miss"}' in metrics
    with pytest.raises(anthropic.NotFoundError) as err:  # the SDK reads the shape as its own
        create(gw, model="no-such-model", messages=user("Hi"))
    assert err.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_an_unknown_key_in_keys_mode_is_an_authentication_error(backend_url: str, tmp_path: Path) -> None:  # noqa: F811
    s = settings_for(tmp_path, [backend_url])
    keys = s.tenants.model_copy(update={"mode": "keys", "keys": {"alice": "sk-alice"}})
    with gateway(s.model_copy(update={"tenants": keys})) as url:
        with pytest.raises(anthropic.AuthenticationError) as err:
            create(url, key="sk-mallory", messages=user("Hi"), max_tokens=4)
        assert err.value.status_code == 401 and err.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        message, _ = create(url, key="sk-alice", messages=user("Hi"), max_tokens=4)
        assert message.type == "message"


def test_cache_control_becomes_cache_pins_for_a_backend_that_pins(tmp_path: Path) -> None:
    """Test servers here, not the engine: the built-in engine does not take ``cache_pins`` yet, and
    what matters is the body the gateway sends each kind of backend (pins only to one that pins)."""
    pinned, plain = Upstream("pinned"), Upstream("plain")
    with (
        serve_in_thread(recording_upstream(pinned)) as url_pinned,
        serve_in_thread(recording_upstream(plain)) as url_plain,
    ):
        backends = [{"url": f"{url_pinned}/v1", "pins": True}, f"{url_plain}/v1"]
        with gateway(settings_for(tmp_path, backends, serve_unset_temperature=True)) as url:  # type: ignore[list-item]
            system = [
                {"type": "text", "text": "You answer about colours."},
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
            ]
            hour = {"type": "ephemeral", "ttl": "1h"}
            turn = {"type": "text", "text": "What colour is the sky?", "cache_control": hour}
            messages = [{"role": "user", "content": [turn]}]
            for model, up in (("pinned", pinned), ("plain", plain)):
                message, h = create(url, model=model, system=system, messages=messages)
                assert h["x-cache"] == "miss" and text_of(message) == "blue"
                assert message.usage.input_tokens == 5 and message.usage.cache_read_input_tokens == 0
                [(_, _, _, sent)] = up.requests("/v1/chat/completions")
                body = json.loads(sent)
                assert body["messages"][0] == {"role": "system", "content": SYSTEM_TEXT}
                if up is pinned:
                    assert body["cache_pins"] == [{"messages": 1, "ttl": 300}, {"messages": 2, "ttl": 3600}]
                else:
                    assert "cache_pins" not in body
            # where the breakpoints sit is not part of the question: the same one without them is a hit
            _, h = create(url, model="pinned", system=SYSTEM_TEXT, messages=user("What colour is the sky?"))
            assert h["x-cache"] == "exact-hit"


def test_usage_maps_cached_and_pinned_tokens() -> None:
    """The engine reports what it read from its prefix cache and what it pinned; creation is the part of
    the pinned prefix not read from the cache. Without ``pinned_tokens`` nothing was created."""
    details = {"cached_tokens": 30, "pinned_tokens": 100}
    chat = {"prompt_tokens": 120, "completion_tokens": 7, "prompt_tokens_details": details}
    assert aa.usage(chat) == {
        "input_tokens": 20,
        "cache_creation_input_tokens": 70,
        "cache_read_input_tokens": 30,
        "output_tokens": 7,
    }
    older = {"prompt_tokens": 120, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 64}}
    assert aa.usage(older)["cache_creation_input_tokens"] == 0 and aa.usage(older)["input_tokens"] == 56


def test_a_failed_stream_ends_with_an_anthropic_error_event() -> None:
    shape = MessagesStream("msg_1", MODEL)
    events = [*shape.text("Hel"), *shape.error({"error": {"message": "backend went away", "code": "x"}})]
    kinds = [e.split(b"\n")[0].removeprefix(b"event: ") for e in events]
    assert kinds == [b"message_start", b"content_block_start", b"content_block_delta", b"error"]
    data = json.loads(events[-1].split(b"data: ", 1)[1])
    assert data == {"type": "error", "error": {"type": "api_error", "message": "backend went away"}}


def test_litellm_as_a_client(gw: str) -> None:
    """LiteLLM's Anthropic provider posts to {api_base}/v1/messages with x-api-key, as the SDK does."""
    litellm = pytest.importorskip("litellm")
    ask = user("What is the capital of Italy?")
    first, _ = create(gw, messages=ask)
    answer = litellm.completion(
        model=f"anthropic/{MODEL}", api_base=gw, api_key="tenant-a", messages=ask, max_tokens=32
    )
    assert answer._hidden_params["additional_headers"]["llm_provider-x-cache"] == "exact-hit"
    assert answer.choices[0].message.content == text_of(first)  # the entry the SDK's request made


def test_a_stop_sequence_met_is_named(gw: str) -> None:
    """The engine names the stop string it met (as vLLM's ``stop_reason``), so Messages can say
    ``stop_sequence``; a stream's reassembled answer keeps it too."""
    kw = {"messages": user("Write a sentence about the sea."), "stop_sequences": ["e"], "max_tokens": 40}
    message, _ = create(gw, **kw, extra_body={"temperature": 0})
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "e"
    kw["messages"] = user("Write a sentence about the sky.")
    _, _, final, _ = stream(gw, **kw, extra_body={"temperature": 0})
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "e"
