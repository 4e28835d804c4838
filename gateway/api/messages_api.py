"""``POST /v1/messages``: Anthropic's Messages API, answered through the chat pipeline.

The body is translated into the chat-completions body a chat client would send for the same
conversation (protocol/anthropic_messages.py), so Messages and chat completions share exact and
semantic cache entries; the pipeline's answer, hit or miss, JSON or stream, is translated back
(gateway/api/translate.py). Every error on this route is in Anthropic's shape, never OpenAI's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cachegw.gateway.api.deps import started
from cachegw.gateway.api.translate import chat_answer, translated
from cachegw.gateway.metrics import GatewayMetrics
from cachegw.protocol import anthropic_answers as aa
from cachegw.protocol import anthropic_messages as am
from cachegw.protocol.errors import ApiError
from cachegw.protocol.http import read_limited_body


def sse(kind: str, data: dict[str, Any]) -> bytes:
    """One event as Anthropic streams it: its type named on the ``event:`` line and in the data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


def _read(chat: dict[str, Any]) -> tuple[str, list[dict[str, Any]], tuple[str, str | None]]:
    """(text, tool calls, (stop_reason, stop_sequence)) of a chat completion, a backend's or the cache's;
    a backend that names the stop string it matched (vLLM's ``stop_reason``) gives the stop_sequence."""
    text, calls, finish = chat_answer(chat)
    matched = ((chat.get("choices") or [{}])[0] or {}).get("stop_reason")
    return text, calls, aa.stop_reason(finish, bool(calls), matched)


def _answer(chat: dict[str, Any], msg_id: str, model: str) -> dict[str, Any]:
    """A chat completion as an Anthropic message."""
    text, calls, stop = _read(chat)
    return aa.message(msg_id, model, text, calls, stop, aa.usage(chat.get("usage")))


class MessagesStream:
    """Anthropic's stream events from the chat stream's pieces: ``message_start`` before the first
    block, each text run or tool call one content block (opened, its deltas, closed), then
    ``message_delta`` with the stop reason and the whole usage (the chat stream gives usage last, so
    ``message_start`` carries zeros), and ``message_stop``."""

    def __init__(self, msg_id: str, model: str) -> None:
        self.msg_id, self.model = msg_id, model
        self.started = False
        self.blocks = 0  # content blocks opened so far
        self.open: tuple[str, int] | None = None  # ("text", block) or ("tool", chat call index)
        self.tool_blocks: dict[int, int] = {}  # chat tool-call index -> content block index

    def start(self) -> Iterable[bytes]:
        if not self.started:
            self.started = True
            head = {"id": self.msg_id, "type": "message", "role": "assistant", "content": []}
            tail = {"stop_reason": None, "stop_sequence": None, "usage": aa.usage(None)}
            yield sse("message_start", {"message": {**head, "model": self.model, **tail}})

    def _close(self) -> Iterable[bytes]:
        if self.open is not None:
            kind, n = self.open
            yield sse("content_block_stop", {"index": n if kind == "text" else self.tool_blocks[n]})
            self.open = None

    def _open(self, block: dict[str, Any]) -> Iterable[bytes]:
        yield from self._close()
        yield sse("content_block_start", {"index": self.blocks, "content_block": block})
        self.blocks += 1

    def text(self, piece: str) -> Iterable[bytes]:
        yield from self.start()
        if self.open is None or self.open[0] != "text":
            yield from self._open({"type": "text", "text": ""})
            self.open = ("text", self.blocks - 1)
        delta = {"type": "text_delta", "text": piece}
        yield sse("content_block_delta", {"index": self.open[1], "delta": delta})

    def tool_call(self, index: int, call_id: str, name: str) -> Iterable[bytes]:
        yield from self.start()
        if index in self.tool_blocks:  # its id and name came in two chunks: the block is open already
            return
        block = {"type": "tool_use", "id": aa.tool_use_id(call_id), "name": name, "input": {}}
        yield from self._open(block)
        self.tool_blocks[index] = self.blocks - 1
        self.open = ("tool", index)

    def tool_arguments(self, index: int, piece: str) -> Iterable[bytes]:
        if index not in self.tool_blocks:  # arguments before the call's name: nothing to attach them to
            return
        delta = {"type": "input_json_delta", "partial_json": piece}
        yield sse("content_block_delta", {"index": self.tool_blocks[index], "delta": delta})

    def finish(self, complete: dict[str, Any] | None, usage: dict[str, Any] | None) -> Iterable[bytes]:
        if complete is None:
            yield from self.error({"error": {"message": "The backend's stream ended before its answer did."}})
            return
        yield from self.start()
        yield from self._close()
        _, _, (reason, sequence) = _read(complete)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield sse("message_delta", {"delta": delta, "usage": aa.usage(usage or complete.get("usage"))})
        yield sse("message_stop", {})

    def error(self, body: dict[str, Any]) -> Iterable[bytes]:
        yield sse("error", {"error": aa.error_from_openai(body, 500)["error"]})


def _error(metrics: GatewayMetrics | None, exc: ApiError) -> Response:
    """An ApiError in Anthropic's shape, counted as the app's error handlers count theirs."""
    if metrics is not None:
        metrics.count_error(exc.status, exc.code or exc.type)
    return JSONResponse(aa.error(exc.status, exc.message), status_code=exc.status, headers=exc.headers)


def messages_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API over the gateway's one cache (docs/apis.md); parts are read here,
        not through dependencies, so that even "the gateway is starting" is in Anthropic's shape."""
        metrics = None
        try:
            parts = started(request)
            metrics = parts.metrics
            parts.tenants.from_headers(request.headers)  # a 401 before any 400 of the body
            raw = await read_limited_body(request, parts.live.current.gateway.max_request_bytes)
            req = am.parse_messages_request(raw)
            chat = am.to_chat_body(req)
            response = await parts.pipeline.handle(
                request, "chat", api="messages", raw=json.dumps(chat, ensure_ascii=False).encode()
            )
        except ApiError as exc:
            return _error(metrics, exc)
        msg_id = aa.message_id(response.headers.get("x-request-id", ""))

        def convert(body: dict[str, Any], status: int) -> tuple[dict[str, Any], int]:
            if status != 200:  # a backend's own error, passed on in this API's shape
                return aa.error_from_openai(body, status), status
            try:
                return _answer(body, msg_id, req.model), 200
            except ApiError as exc:
                return aa.error(exc.status, exc.message), exc.status

        out = translated(response, convert, lambda: MessagesStream(msg_id, req.model))
        out.headers["request-id"] = response.headers.get("x-request-id", "")
        return out

    return router
