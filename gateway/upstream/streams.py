"""Streams from a backend: relayed event by event with no added buffering while an ``SseRecorder``
reads the same bytes to rebuild the complete answer for the cache and the request log; a stream the
backend breaks, or stops sending because it hung, ends with an OpenAI-style error event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import httpx

from cachegw.protocol import sse

T = TypeVar("T")


class MarkedDown(Exception):
    """The health probes marked the backend down while a request to it was waiting."""


async def unless_gone(gone: asyncio.Event | None, work: Awaitable[T]) -> T:
    """``work``'s result, or ``MarkedDown`` as soon as ``gone`` is set: a request already waiting on a
    backend that hung would otherwise hold its caller for the whole read timeout."""
    if gone is None:
        return await work
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(gone.wait())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()  # marked down, or our caller was cancelled
    if task not in done:
        raise MarkedDown
    return task.result()


class SseRecorder:
    """Rebuilds a non-stream response from the SSE bytes of a chat or completion stream."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.meta: dict[str, Any] = {}
        self.done = False
        self.error = False
        self.calls: dict[int, dict[str, Any]] = {}  # tool calls by index, reassembled from their deltas
        self.extra: dict[str, list[Any]] = {}  # other delta fields (refusal, reasoning_content, ...)
        self.relayed_bytes = 0  # passed on to the client so far
        self.broken: str | None = None  # why the backend's stream ended before [DONE], if it did

    def feed_event(self, event: bytes) -> bool:
        """Read one SSE event; True if it is the usage-only chunk (no choices)."""
        data = sse.data_of(event)
        return False if data is None else self._data(data.strip())

    def _data(self, data: bytes) -> bool:
        if data == b"[DONE]":
            self.done = True
            return False
        try:
            obj = json.loads(data)
        except ValueError:
            self.error = True
            return False
        if "error" in obj:
            self.error = True
            return False
        if obj.get("usage"):
            self.usage = obj["usage"]
        for key in ("id", "model", "created", "system_fingerprint"):
            self.meta.setdefault(key, obj.get(key))
        for choice in obj.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            if self.endpoint == "chat":
                delta = choice.get("delta") or {}
                if not self._tool_call_deltas(delta.get("tool_calls")):
                    self.error = True  # pieces that cannot be put together: never stored
                if delta.get("content"):
                    self.text.append(delta["content"])
                for key, value in delta.items():
                    if key not in ("role", "content", "tool_calls") and value not in (None, "", []):
                        self.extra.setdefault(key, []).append(value)
            elif choice.get("text"):
                self.text.append(choice["text"])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")  # the stop string met (vLLM, our engine)
        return obj.get("choices") == [] and bool(obj.get("usage"))

    def _tool_call_deltas(self, deltas: Any) -> bool:
        """Fold one chunk's tool-call deltas into ``calls`` as the openai SDK does: by ``index``, the
        name and arguments concatenated from their pieces, ``id`` and ``type`` from the chunk that
        carries them. False for pieces that are not shaped like a tool-call delta."""
        if deltas in (None, []):
            return True
        if not isinstance(deltas, list):
            return False
        for d in deltas:
            index = d.get("index") if isinstance(d, dict) else None
            if not isinstance(index, int) or isinstance(index, bool):
                return False
            call = self.calls.setdefault(index, {"id": "", "type": "function", "function": {}})
            if d.get("id"):
                call["id"] = d["id"]
            if d.get("type"):
                call["type"] = d["type"]
            fn = d.get("function") or {}
            if not isinstance(fn, dict):
                return False
            for key in ("name", "arguments"):
                piece = fn.get(key)
                if piece is not None and not isinstance(piece, str):
                    return False
                call["function"][key] = call["function"].get(key, "") + (piece or "")
        return True

    def complete_response(self) -> dict[str, Any] | None:
        """The answer as one non-stream response, or None unless the stream ended well."""
        if not self.done or self.error or self.finish_reason is None:
            return None
        text = "".join(self.text)
        if self.endpoint == "chat":
            extra = {
                k: "".join(v) if all(isinstance(x, str) for x in v) else v for k, v in self.extra.items()
            }
            if self.calls:  # as OpenAI's JSON has them: content null when the answer is only calls
                extra["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text or (None if self.calls else ""), **extra},
                "finish_reason": self.finish_reason,
            }
            if self.stop_reason is not None:
                choice["stop_reason"] = self.stop_reason
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": self.finish_reason, "logprobs": None}
            obj = "text_completion"
        return {
            "id": self.meta.get("id"),
            "object": obj,
            "created": self.meta.get("created"),
            "model": self.meta.get("model"),
            "choices": [choice],
            "usage": self.usage,
        }


async def relay(
    response: httpx.Response,
    recorder: SseRecorder,
    drop_usage_chunk: bool,
    gone: asyncio.Event | None = None,
) -> AsyncIterator[bytes]:
    """The backend's SSE events as they arrive, each passed on whole. When the gateway asked for a
    usage chunk that the client did not (to record tokens), that one event is held back.

    A stream the backend breaks (connection lost, or closed before ``[DONE]``) ends with one
    OpenAI-style error event instead of a dropped connection, so clients can tell a fault from an
    answer; ``recorder.broken`` says why, and such an answer is never stored. ``gone`` (the backend
    marked down by the health probes) ends a stream that hung the same way."""
    splitter = sse.EventSplitter()

    def passed(events: list[bytes]) -> Iterator[bytes]:
        for event in events:
            if recorder.feed_event(event) and drop_usage_chunk:
                continue
            recorder.relayed_bytes += len(event) + 2
            yield event + b"\n\n"

    try:
        try:
            async for chunk in _chunks(response, gone):
                for out in passed(splitter.feed(chunk)):
                    yield out
            for out in passed(splitter.close()):
                yield out
        except httpx.HTTPError as exc:  # the backend died or the connection broke mid-stream
            recorder.broken = f"{type(exc).__name__}: {exc}"[:200] or type(exc).__name__
        except MarkedDown:
            recorder.broken = "the backend stopped answering (marked down by the health probes)"
        buffer = splitter.rest
        if buffer.strip() and recorder.broken is None:
            recorder.feed_event(buffer)
            recorder.relayed_bytes += len(buffer)
            yield buffer
        elif buffer.strip():
            recorder.error = True  # a torn last event: never part of a stored answer
        if recorder.broken is None and not recorder.done and not recorder.error:
            recorder.broken = "the backend closed the stream before [DONE]"
        if recorder.broken is not None:
            recorder.error = True
            yield stream_error_event(f"The backend's stream broke: {recorder.broken}")
    finally:
        await response.aclose()


async def _chunks(response: httpx.Response, gone: asyncio.Event | None) -> AsyncIterator[bytes]:
    """The response's raw chunks; with ``gone``, read by a task of their own so that the backend being
    marked down ends the wait at once (one task per stream, not per chunk: a chunk costs a queue hop)."""
    if gone is None:
        async for chunk in response.aiter_raw():
            yield chunk
        return
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()

    async def read() -> None:
        try:
            async for chunk in response.aiter_raw():
                queue.put_nowait(chunk)
            queue.put_nowait(None)
        except Exception as exc:  # httpx errors: re-raised where the relay reads
            queue.put_nowait(exc)

    def marked_down(watch: asyncio.Future) -> None:
        if not watch.cancelled():
            reader.cancel()
            queue.put_nowait(MarkedDown())

    reader = asyncio.ensure_future(read())
    watch = asyncio.ensure_future(gone.wait())
    watch.add_done_callback(marked_down)
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        watch.cancel()
        reader.cancel()


def stream_error_event(message: str, code: str = "backend_error") -> bytes:
    """One SSE event carrying an OpenAI-style error body (what OpenAI sends for a failed stream)."""
    return sse.error_event(message, code)


class StreamRelay:
    """One client stream: the relayed events, the recorder reading them, and the bookkeeping at the
    end (``finish``: log the request, store a complete answer). ``finish`` runs exactly once: before
    ``[DONE]`` reaches the client (a repeat sent right after must find the answer), after a broken
    stream's error event, or, when the client goes away, as a task kept in ``tasks`` (an unreferenced
    task can be collected mid-run)."""

    def __init__(
        self,
        response: httpx.Response,
        recorder: SseRecorder,
        finish: Callable[[SseRecorder], Coroutine[Any, Any, None]],
        tasks: set[asyncio.Task],
        drop_usage_chunk: bool,
        gone: asyncio.Event | None = None,
    ) -> None:
        self.response, self.recorder, self._finish = response, recorder, finish
        self.tasks, self.drop_usage_chunk, self.gone = tasks, drop_usage_chunk, gone
        self.finished = False

    async def _finish_once(self) -> None:
        if not self.finished:
            self.finished = True
            await self._finish(self.recorder)

    async def events(self) -> AsyncIterator[bytes]:
        try:
            async for event in relay(self.response, self.recorder, self.drop_usage_chunk, self.gone):
                if self.recorder.done:
                    await self._finish_once()
                yield event
            await self._finish_once()  # the backend broke the stream: relay ended it with an error event
        finally:  # the client went away: record it, store nothing
            if not self.finished:
                self.finished = True
                task = asyncio.get_running_loop().create_task(self._finish(self.recorder))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
