"""Responses API answers: the Response object and its typed stream events, from a chat answer.

One ``ResponseBuilder`` per request mints the ids (``resp_``, ``msg_``, ``fc_``), so the events of a
stream and the Response that ``response.completed`` carries (and the store keeps) name the same items.
The stream writes the events in the order the openai SDK assembles them: the response created, each
output item added, its text or arguments in deltas, each item done, then ``response.completed``
(``response.incomplete`` when the answer was cut by ``max_output_tokens``).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

from cachegw.protocol.responses_request import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def sse_event(kind: str, payload: dict[str, Any]) -> bytes:
    """One typed event: the ``event:`` line names it, the data repeats it in ``type``."""
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    details = chat_usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    input_details: dict[str, int] = {"cached_tokens": cached}
    if details.get("pinned_tokens") is not None:  # a backend that pins (prompt_cache_retention)
        input_details["cache_write_tokens"] = max(0, int(details["pinned_tokens"]) - cached)
    return {
        "input_tokens": prompt,
        "input_tokens_details": input_details,
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice or "auto"
    return choice.model_dump()


class ResponseBuilder:
    """The Response for one request; ``items`` turn a chat answer into output items."""

    def __init__(self, req: ResponsesRequest, response_id: str | None = None) -> None:
        self.req = req
        self.id = response_id or _id("resp")
        self.created_at = int(time.time())
        self.message_id = _id("msg")
        self._call_ids: dict[int, str] = {}

    def call_item_id(self, index: int) -> str:
        return self._call_ids.setdefault(index, _id("fc"))

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [part] if status == "completed" else [],
        }

    def call_item(self, index: int, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": self.call_item_id(index),
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def output(self, text: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        items = [self.message_item(text)] if text or not calls else []
        for i, call in enumerate(calls):
            fn = call.get("function") or {}
            items.append(
                self.call_item(
                    i, str(call.get("id") or ""), fn.get("name") or "", fn.get("arguments") or "", "completed"
                )
            )
        return items

    def response(
        self,
        output: list[dict[str, Any]],
        status: str,
        model: str | None,
        usage: dict[str, Any] | None,
        finish_reason: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        req = self.req
        text_format = (
            req.text.format.model_dump(by_alias=True, exclude_none=True)
            if req.text and req.text.format
            else {"type": "text"}
        )
        cut = finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if cut and status == "completed" else status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": model or req.model or "",
            "output": output,
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": _tool_choice(req),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": text_format},
            "truncation": req.truncation or "disabled",
            "store": req.store is not False,
            "metadata": req.metadata or {},
            "user": req.user,
            "usage": _usage(usage),
        }

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Response for a complete chat completion."""
        choice = (chat.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        text = message.get("content") if isinstance(message.get("content"), str) else ""
        calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
        output = self.output(text or "", calls)
        return self.response(
            output, "completed", chat.get("model"), chat.get("usage"), choice.get("finish_reason")
        )


class ResponseStream:
    """The typed events of a streamed Response, written from the chat stream's pieces (a
    ``gateway.api.translate.StreamShape``). ``final`` is the Response ``response.completed`` carried."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.b = builder
        self.seq = 0
        self.final: dict[str, Any] | None = None
        self._text: list[str] | None = None  # the message item's text, while it is open
        self._outputs = 0  # output items added so far
        self._call: tuple[int, int, str, str, list[str]] | None = None  # index, output index, id, name, args

    def _event(self, kind: str, **payload: Any) -> bytes:
        out = sse_event(kind, {**payload, "sequence_number": self.seq})
        self.seq += 1
        return out

    def start(self) -> Iterator[bytes]:
        shell = self.b.response([], "in_progress", None, None)
        yield self._event("response.created", response=shell)
        yield self._event("response.in_progress", response=shell)

    def _close_text(self) -> Iterator[bytes]:
        if self._text is None:
            return
        text, index = "".join(self._text), self._outputs - 1
        ids = {"item_id": self.b.message_id, "output_index": index, "content_index": 0}
        yield self._event("response.output_text.done", **ids, text=text, logprobs=[])
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        yield self._event("response.content_part.done", **ids, part=part)
        yield self._event("response.output_item.done", output_index=index, item=self.b.message_item(text))
        self._text = None

    def _close_call(self) -> Iterator[bytes]:
        if self._call is None:
            return
        index, out_index, call_id, name, args = self._call
        arguments, item_id = "".join(args), self.b.call_item_id(index)
        yield self._event(
            "response.function_call_arguments.done",
            item_id=item_id,
            output_index=out_index,
            arguments=arguments,
            name=name,
        )
        item = self.b.call_item(index, call_id, name, arguments, "completed")
        yield self._event("response.output_item.done", output_index=out_index, item=item)
        self._call = None

    def text(self, piece: str) -> Iterator[bytes]:
        if self._text is None:
            yield from self._close_call()
            self._text, index = [], self._outputs
            self._outputs += 1
            yield self._event(
                "response.output_item.added", output_index=index, item=self.b.message_item("", "in_progress")
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            ids = {"item_id": self.b.message_id, "output_index": index, "content_index": 0}
            yield self._event("response.content_part.added", **ids, part=part)
        self._text.append(piece)
        ids = {"item_id": self.b.message_id, "output_index": self._outputs - 1, "content_index": 0}
        yield self._event("response.output_text.delta", **ids, delta=piece, logprobs=[])

    def tool_call(self, index: int, call_id: str, name: str) -> Iterator[bytes]:
        if self._call is not None and self._call[0] == index:
            return
        yield from self._close_text()
        yield from self._close_call()
        out_index = self._outputs
        self._outputs += 1
        self._call = (index, out_index, call_id, name, [])
        item = self.b.call_item(index, call_id, name, "", "in_progress")
        yield self._event("response.output_item.added", output_index=out_index, item=item)

    def tool_arguments(self, index: int, piece: str) -> Iterator[bytes]:
        if self._call is None or self._call[0] != index:
            return
        self._call[4].append(piece)
        item_id = self.b.call_item_id(index)
        yield self._event(
            "response.function_call_arguments.delta", item_id=item_id, output_index=self._call[1], delta=piece
        )

    def finish(self, complete: dict[str, Any] | None, usage: dict[str, Any] | None) -> Iterator[bytes]:
        yield from self._close_text()
        yield from self._close_call()
        if complete is None:
            error = {
                "code": "server_error",
                "message": "The backend's stream ended before the answer was complete.",
            }
            self.final = self.b.response([], "failed", None, usage, error=error)
            yield self._event("response.failed", response=self.final)
            return
        self.final = self.b.from_chat({**complete, "usage": usage or complete.get("usage")})
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        yield self._event(kind, response=self.final)

    def error(self, body: dict[str, Any]) -> Iterator[bytes]:
        found = body.get("error")
        err: dict[str, Any] = found if isinstance(found, dict) else {}
        yield self._event(
            "error",
            code=err.get("code") or err.get("type") or "server_error",
            message=err.get("message") or "The backend failed.",
            param=err.get("param"),
        )
