"""The answer to a Messages request in Anthropic's shape, from the pieces of a chat completion: the
message, its usage in prompt-caching terms, the stop reason, and Anthropic's error shape (the request
side is protocol/anthropic_messages.py)."""

from __future__ import annotations

import json
import secrets
from typing import Any

from cachegw.protocol.errors import ApiError


def message_id(request_id: str) -> str:
    """``msg_`` and the gateway's request id (``req-<hex>``): feedback can name it by x-request-id."""
    return "msg_" + (request_id.removeprefix("req-") or secrets.token_hex(12))


def tool_use_id(call_id: str) -> str:
    return "toolu_" + (call_id.removeprefix("call_") or secrets.token_hex(12))


def usage(chat_usage: dict[str, Any] | None) -> dict[str, int]:
    """Chat usage in Anthropic's terms: tokens read from the backend's prompt cache, tokens it newly
    pinned (``pinned_tokens`` not yet read from it), the rest of the prompt, and the output."""
    u = chat_usage or {}
    details = u.get("prompt_tokens_details") or {}
    read = int(details.get("cached_tokens") or 0)
    creation = max(0, int(details.get("pinned_tokens") or 0) - read)
    return {
        "input_tokens": max(0, int(u.get("prompt_tokens") or 0) - read - creation),
        "cache_creation_input_tokens": creation,
        "cache_read_input_tokens": read,
        "output_tokens": int(u.get("completion_tokens") or 0),
    }


def stop_reason(finish: str | None, has_calls: bool, matched: Any) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). ``matched`` is the stop string a backend names (vLLM's
    ``stop_reason``); without it a stop reads ``end_turn``."""
    if finish == "length":
        return "max_tokens", None
    if has_calls or finish == "tool_calls":
        return "tool_use", None
    if finish == "content_filter":
        return "refusal", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's ``input`` is; ApiError(502) if they are not."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ApiError(502, "The backend's tool call arguments are not a JSON object.", type="api_error")
    return value


def message(
    msg_id: str, model: str, text: str, calls: list[dict[str, Any]], stop: tuple[str, str | None], use: dict
) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for call in calls:
        fn = call.get("function") or {}
        block = {"type": "tool_use", "id": tool_use_id(call.get("id") or ""), "name": fn.get("name") or ""}
        content.append(block | {"input": tool_input(fn.get("arguments") or "")})
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": use,
    }


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error(status: int, message_text: str) -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": error_type(status), "message": message_text}}


def error_from_openai(body: dict[str, Any], status: int) -> dict[str, Any]:
    """A pipeline or backend error (OpenAI's shape) in Anthropic's."""
    err = body.get("error")
    text = err.get("message") if isinstance(err, dict) else None
    return error(status, str(text or err or f"The backend answered with status {status}."))
