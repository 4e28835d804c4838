"""Answers from the cache, as JSON or as an SSE stream in OpenAI's chunk format.

A stored tool call is replayed under a fresh id (``call_`` + 24 random hex digits, as OpenAI's): ids
name one call of one conversation, and a client that keys its own state by them must never see one
twice. The cache keys tool-call ids by position, so the follow-up turn still repeats exactly.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

from cachegw.protocol import sse
from cachegw.protocol.tool_calls import new_call_id

_PIECE = re.compile(r"\S+\s*|\s+")
WORDS_PER_CHUNK = 4
ARGUMENT_CHARS_PER_CHUNK = 16  # a tool call's arguments stream in pieces of this many characters


def with_fresh_call_ids(stored: dict[str, Any]) -> dict[str, Any]:
    """A copy of a chat answer whose tool calls carry new ids (the stored answer is not modified)."""
    choices = stored.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return stored
    message = choices[0].get("message")
    if not isinstance(message, dict) or not isinstance(message.get("tool_calls"), list):
        return stored
    calls = message["tool_calls"]
    fresh = [{**c, "id": new_call_id()} if isinstance(c, dict) else c for c in calls]
    choice = {**choices[0], "message": {**message, "tool_calls": fresh}}
    return {**stored, "choices": [choice, *choices[1:]]}


def hit_response(stored: dict[str, Any], request_id: str) -> dict[str, Any]:
    """The stored answer under this request's id and time, its tool calls under fresh ids."""
    return {**with_fresh_call_ids(stored), "id": request_id, "created": int(time.time())}


def _pieces(text: str) -> list[str]:
    words = _PIECE.findall(text)
    return ["".join(words[i : i + WORDS_PER_CHUNK]) for i in range(0, len(words), WORDS_PER_CHUNK)] or [""]


def hit_stream(
    stored: dict[str, Any], request_id: str, endpoint: str, include_usage: bool
) -> Iterator[bytes]:
    """Several chunks of a few words, the finish reason, the usage chunk if asked, then [DONE]."""
    choice = (stored.get("choices") or [{}])[0]
    head = {"id": request_id, "created": int(time.time()), "model": stored.get("model")}
    finish = choice.get("finish_reason")
    usage = {"usage": None} if include_usage else {}
    if endpoint == "chat":
        head["object"] = "chat.completion.chunk"
        message = choice.get("message") or {}
        text = message.get("content") or ""
        calls = with_fresh_call_ids(stored)["choices"][0]["message"].get("tool_calls") or []

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
            return sse.event(
                {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], **usage}
            )

        # OpenAI opens a tool-call-only answer with content null, a text answer with ""
        yield chunk({"role": "assistant", "content": "" if text or not calls else None})
        for piece in _pieces(text) if text or not calls else []:
            yield chunk({"content": piece})
        for i, call in enumerate(calls):
            yield from _tool_call_chunks(chunk, i, call)
        yield chunk({}, finish)
    else:
        head["object"] = "text_completion"
        pieces = _pieces(choice.get("text") or "")
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield sse.event(
                {
                    **head,
                    "choices": [
                        {
                            "index": 0,
                            "text": piece,
                            "logprobs": None,
                            "finish_reason": finish if last else None,
                        }
                    ],
                    **usage,
                }
            )
    if include_usage:
        yield sse.event({**head, "choices": [], "usage": stored.get("usage")})
    yield sse.DONE


def _tool_call_chunks(chunk: Any, index: int, call: dict[str, Any]) -> Iterator[bytes]:
    """One call as OpenAI streams it: index, id, type and name first, then the arguments in pieces."""
    fn = call.get("function") or {}
    arguments = fn.get("arguments") or ""
    head = {"index": index, "id": call.get("id"), "type": call.get("type", "function")}
    yield chunk({"tool_calls": [{**head, "function": {"name": fn.get("name"), "arguments": ""}}]})
    for start in range(0, len(arguments), ARGUMENT_CHARS_PER_CHUNK):
        piece = arguments[start : start + ARGUMENT_CHARS_PER_CHUNK]
        yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
