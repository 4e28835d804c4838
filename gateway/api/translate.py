"""The other APIs' answers, rebuilt from the chat completions the pipeline gives.

The Responses and Messages routes translate a request into a chat body, let the pipeline answer it
(cache, backend, request log: one path for every API), then translate the answer back. A JSON answer
is converted whole; a stream is read chunk by chunk, its deltas handed to a ``StreamShape`` that writes
the API's own events, and the complete answer (rebuilt as the cache rebuilds it) closes the stream.
Hits and misses alike come out of the pipeline as chat, so both are replayed in the caller's shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Protocol

from fastapi.responses import JSONResponse, Response, StreamingResponse

from cachegw.gateway.upstream.streams import SseRecorder
from cachegw.protocol import sse

Convert = Callable[[dict[str, Any], int], tuple[dict[str, Any], int]]


class StreamShape(Protocol):
    """Writes one API's stream events from a chat stream's pieces (each call returns SSE bytes)."""

    def start(self) -> Iterable[bytes]:
        """The opening events, before the first piece (the response or message created)."""
        ...

    def text(self, piece: str) -> Iterable[bytes]: ...

    def tool_call(self, index: int, call_id: str, name: str) -> Iterable[bytes]: ...

    def tool_arguments(self, index: int, piece: str) -> Iterable[bytes]: ...

    def finish(self, complete: dict[str, Any] | None, usage: dict[str, Any] | None) -> Iterable[bytes]:
        """The closing events: ``complete`` is the whole chat answer, None when the stream broke."""
        ...

    def error(self, body: dict[str, Any]) -> Iterable[bytes]:
        """An error event in the chat stream (OpenAI's error object), in this API's shape."""
        ...


def _body_of(response: Response) -> dict[str, Any]:
    try:
        body = json.loads(bytes(response.body))
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _headers_of(response: Response) -> dict[str, str]:
    """The gateway's own headers (x-cache, x-request-id, ...); the length and type are set anew."""
    skip = {"content-length", "content-type"}
    return {k: v for k, v in response.headers.items() if k.lower() not in skip}


def translated(
    response: Response,
    convert: Convert,
    shape: Callable[[], StreamShape],
    settle: Callable[[], Awaitable[None]] | None = None,
) -> Response:
    """The pipeline's chat answer in another API's shape: ``convert(body, status)`` for JSON (errors
    included: it returns the body and status to send), ``shape()`` for a stream. A stream's ``settle``
    is awaited once its closing events are written and before they are sent (a Response is stored
    before the client reads ``response.completed`` and may go on from it)."""
    if isinstance(response, StreamingResponse):
        events = _translate_stream(response.body_iterator, shape(), settle)
        return StreamingResponse(events, media_type="text/event-stream", headers=_headers_of(response))
    body, status = convert(_body_of(response), response.status_code)
    return JSONResponse(body, status_code=status, headers=_headers_of(response))


async def _translate_stream(
    chunks: AsyncIterable[Any], shape: StreamShape, settle: Callable[[], Awaitable[None]] | None
) -> AsyncIterator[bytes]:
    """The chat stream's events in ``shape``; the inner stream is closed with this one, so a client that
    goes away still ends the backend's stream and its bookkeeping (gateway/upstream/streams.py)."""
    splitter, recorder = sse.EventSplitter(), SseRecorder("chat")
    failed = False
    for out in shape.start():
        yield out
    try:
        async for chunk in chunks:
            for event in splitter.feed(chunk if isinstance(chunk, bytes) else str(chunk).encode()):
                recorder.feed_event(event)
                data = sse.data_of(event)
                if data is None or data.strip() == b"[DONE]":
                    continue
                try:
                    obj = json.loads(data)
                except ValueError:
                    continue
                if isinstance(obj, dict) and "error" in obj:
                    failed = True
                    for out in shape.error(obj):
                        yield out
                    continue
                for out in _deltas(obj, shape):
                    yield out
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
    if failed:
        return
    closing = list(shape.finish(recorder.complete_response(), recorder.usage))
    if settle is not None:
        await settle()
    for out in closing:
        yield out


def _deltas(chunk: dict[str, Any], shape: StreamShape) -> Iterable[bytes]:
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        delta = choice.get("delta") or {}
        if isinstance(delta.get("content"), str) and delta["content"]:
            yield from shape.text(delta["content"])
        for call in delta.get("tool_calls") or []:
            if not isinstance(call, dict) or not isinstance(call.get("index"), int):
                continue
            fn = call.get("function") or {}
            if call.get("id") or fn.get("name"):
                yield from shape.tool_call(call["index"], call.get("id") or "", fn.get("name") or "")
            if fn.get("arguments"):
                yield from shape.tool_arguments(call["index"], fn["arguments"])


def chat_answer(body: dict[str, Any]) -> tuple[str, list[dict[str, Any]], str | None]:
    """(text, tool calls, finish reason) of a chat completion's first choice."""
    choice = (body.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    text = message.get("content") if isinstance(message.get("content"), str) else ""
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    return text or "", calls, choice.get("finish_reason")
