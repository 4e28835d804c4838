"""Cache hits replayed as JSON and as OpenAI-format SSE streams: the stream reassembles the stored text."""

from __future__ import annotations

import json

import pytest

from cachegw.gateway.request.hits import WORDS_PER_CHUNK, hit_response, hit_stream

TEXT = "The quick brown fox jumps over the lazy dog, twice.\n  Then it rests."
USAGE = {"prompt_tokens": 9, "completion_tokens": 14, "total_tokens": 23}
CHAT = {
    "id": "old",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": TEXT}, "finish_reason": "stop"}],
    "usage": USAGE,
}
COMPLETION = {
    "id": "old",
    "object": "text_completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "text": TEXT, "logprobs": None, "finish_reason": "length"}],
    "usage": USAGE,
}


def events(chunks) -> list:
    raw = b"".join(chunks).decode()
    assert raw.endswith("data: [DONE]\n\n")
    parts = [p for p in raw.split("\n\n") if p]
    assert all(p.startswith("data: ") for p in parts)
    return [json.loads(p[6:]) for p in parts[:-1]]


def test_hit_response_keeps_the_answer_under_the_new_id() -> None:
    out = hit_response(CHAT, "chatcmpl-new")
    assert out["id"] == "chatcmpl-new" and out["created"] > 1
    assert out["choices"] == CHAT["choices"] and out["usage"] == USAGE
    assert CHAT["id"] == "old"  # the stored entry is not modified


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_reassembles_text_with_role_first_and_finish_last(include_usage: bool) -> None:
    evs = events(hit_stream(CHAT, "r1", "chat", include_usage))
    body = [e for e in evs if e["choices"]]
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == "r1" for e in body)
    assert body[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in body) == TEXT
    assert [e["choices"][0]["finish_reason"] for e in body][-1] == "stop"
    assert all(e["choices"][0]["finish_reason"] is None for e in body[:-1])
    pieces = [e["choices"][0]["delta"]["content"] for e in body[1:-1]]
    assert len(pieces) > 1 and all(len(p.split()) <= WORDS_PER_CHUNK for p in pieces)
    if include_usage:
        assert evs[-1]["choices"] == [] and evs[-1]["usage"] == USAGE
        assert all(e["usage"] is None for e in body)
    else:
        assert all("usage" not in e for e in evs)


def test_completion_stream_reassembles_text_with_finish_on_the_last_piece() -> None:
    evs = events(hit_stream(COMPLETION, "r2", "completions", True))
    body = evs[:-1]
    assert all(e["object"] == "text_completion" for e in body)
    assert "".join(e["choices"][0]["text"] for e in body) == TEXT
    assert [e["choices"][0]["finish_reason"] for e in body] == [None] * (len(body) - 1) + ["length"]
    assert evs[-1]["usage"] == USAGE


def test_empty_answer_still_streams_a_finish() -> None:
    empty = {**CHAT, "choices": [{"index": 0, "message": {"content": None}, "finish_reason": "stop"}]}
    body = events(hit_stream(empty, "r3", "chat", False))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in body) == ""
    assert body[-1]["choices"][0]["finish_reason"] == "stop"
    text_body = events(hit_stream({"choices": []}, "r4", "completions", False))
    assert len(text_body) == 1 and text_body[0]["choices"][0]["text"] == ""


CALLS = [
    {
        "id": "call_a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    },
    {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]
TOOL_ANSWER = {
    **CHAT,
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": None, "tool_calls": CALLS},
            "finish_reason": "tool_calls",
        }
    ],
}


def test_a_tool_call_is_replayed_as_json_under_fresh_ids() -> None:
    out = hit_response(TOOL_ANSWER, "r5")
    calls = out["choices"][0]["message"]["tool_calls"]
    assert [c["function"] for c in calls] == [c["function"] for c in CALLS]
    assert all(c["id"].startswith("call_") and c["id"] not in ("call_a", "call_b") for c in calls)
    assert len({c["id"] for c in calls}) == 2 and TOOL_ANSWER["choices"][0]["message"]["tool_calls"] == CALLS


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_tool_call_streams_in_openais_chunk_shapes(include_usage: bool) -> None:
    evs = events(hit_stream(TOOL_ANSWER, "r6", "chat", include_usage))
    body = [e for e in evs if e["choices"]]
    deltas = [e["choices"][0]["delta"] for e in body]
    assert deltas[0] == {"role": "assistant", "content": None}
    assert deltas[-1] == {} and body[-1]["choices"][0]["finish_reason"] == "tool_calls"
    rebuilt: dict[int, dict] = {}
    for d in deltas[1:-1]:
        [call] = d["tool_calls"]
        if "id" in call:  # the first delta of a call: index, id, type, name, no arguments yet
            assert call["type"] == "function" and call["function"]["arguments"] == ""
            assert call["index"] not in rebuilt
            rebuilt[call["index"]] = {"id": call["id"], "name": call["function"]["name"], "arguments": ""}
        else:
            assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            rebuilt[call["index"]]["arguments"] += call["function"]["arguments"]
    assert [(c["name"], c["arguments"]) for c in rebuilt.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in CALLS
    ]
    assert sum(1 for d in deltas if "tool_calls" in d and "id" not in d["tool_calls"][0]) > 2  # in pieces
    assert all(c["id"] not in ("call_a", "call_b") for c in rebuilt.values())
    assert (evs[-1].get("usage") == USAGE) is include_usage


def test_the_stream_recorder_reassembles_tool_call_deltas() -> None:
    from cachegw.gateway.upstream.streams import SseRecorder

    recorder = SseRecorder("chat")
    for chunk in events(hit_stream(TOOL_ANSWER, "r7", "chat", True)):
        recorder.feed_event(b"data: " + json.dumps(chunk).encode())
    recorder.feed_event(b"data: [DONE]")
    done = recorder.complete_response()
    assert done is not None
    message = done["choices"][0]["message"]
    assert message["content"] is None and done["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["function"] for c in message["tool_calls"]] == [c["function"] for c in CALLS]
    broken = SseRecorder("chat")
    broken.feed_event(b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"function": {}}]}}]}')
    broken.feed_event(b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}')
    broken.feed_event(b"data: [DONE]")
    assert broken.complete_response() is None  # a delta without an index cannot be placed


def test_the_stream_recorder_puts_interleaved_parallel_calls_back_by_index() -> None:
    """Two calls whose pieces alternate, one chunk carrying pieces of both, ids only in the first
    delta of each (as vLLM streams parallel calls)."""
    from cachegw.gateway.upstream.streams import SseRecorder

    def delta(*calls: dict) -> bytes:
        chunk = {"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": list(calls)}}]}
        return b"data: " + json.dumps(chunk).encode()

    recorder = SseRecorder("chat")
    for event in (
        delta({"index": 0, "id": "call_x", "type": "function", "function": {"name": "get_weather"}}),
        delta({"index": 1, "id": "call_y", "type": "function", "function": {"name": "get_time"}}),
        delta(
            {"index": 0, "function": {"arguments": '{"city": '}}, {"index": 1, "function": {"arguments": "{"}}
        ),
        delta({"index": 1, "function": {"arguments": "}"}}),
        delta({"index": 0, "function": {"arguments": '"Oslo"}'}}),
        b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}',
        b"data: [DONE]",
    ):
        recorder.feed_event(event)
    done = recorder.complete_response()
    assert done is not None
    calls = done["choices"][0]["message"]["tool_calls"]
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("call_x", "get_weather", '{"city": "Oslo"}'),
        ("call_y", "get_time", "{}"),
    ]
