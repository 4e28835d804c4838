"""Answers from the cache, as JSON or as an SSE stream in OpenAI's chunk format."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

_PIECE = re.compile(r"\S+\s*|\s+")
WORDS_PER_CHUNK = 4


def hit_response(stored: dict[str, Any], request_id: str) -> dict[str, Any]:
    """The stored answer under this request's id and time."""
    return {**stored, "id": request_id, "created": int(time.time())}


def _pieces(text: str) -> list[str]:
    words = _PIECE.findall(text)
    return ["".join(words[i : i + WORDS_PER_CHUNK]) for i in range(0, len(words), WORDS_PER_CHUNK)] or [""]


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


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
        text = (choice.get("message") or {}).get("content") or ""
        yield _sse(
            {
                **head,
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                ],
                **usage,
            }
        )
        for piece in _pieces(text):
            yield _sse(
                {
                    **head,
                    "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}],
                    **usage,
                }
            )
        yield _sse({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}], **usage})
    else:
        head["object"] = "text_completion"
        pieces = _pieces(choice.get("text") or "")
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield _sse(
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
        yield _sse({**head, "choices": [], "usage": stored.get("usage")})
    yield b"data: [DONE]\n\n"
