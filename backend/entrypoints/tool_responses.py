"""Tool calls in the engine's answers: the chat message (JSON) and the stream's deltas, in OpenAI's shape.

An answer that is calls has ``content`` null, each call an id (``call_...``, or the 9 letters and
digits Mistral's template insists on), ``type: function``, the function's name and its arguments as
a JSON string, and ``finish_reason: "tool_calls"`` once every call is whole. A stream sends each
call's index, id, type and name in one delta as soon as the name is out, then its arguments in pieces
as they are generated. An answer that is text is sent as content, as without tools.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from cachegw.backend.core.async_engine import RequestStream
from cachegw.backend.core.outputs import RequestOutput
from cachegw.backend.entrypoints.choices import Cursors
from cachegw.backend.entrypoints.tool_parser import ToolFormat, scan, whole_calls


def _finish(text: str, finish_reason: str | None, fmt: ToolFormat) -> str | None:
    whole = whole_calls(text, fmt) is not None
    return "tool_calls" if whole and finish_reason == "stop" else finish_reason


def tool_message(text: str, finish_reason: str | None, fmt: ToolFormat) -> tuple[dict[str, Any], str | None]:
    """(the assistant message, the finish reason) of a finished answer."""
    result = scan(text, fmt)
    if result.kind != "calls" or not result.calls:
        return {"role": "assistant", "content": text, "refusal": None}, finish_reason
    calls = [
        {"id": fmt.new_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in result.calls
    ]
    message = {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}
    return message, _finish(text, finish_reason, fmt)


class ToolDeltas:
    """Turns a growing output into stream deltas: content while it is text, calls once it is calls."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text_mode = False
        self.sent_chars = 0
        self.ids: list[str] = []
        self.sent_args: list[int] = []

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        result = scan(text, self.fmt)
        if not self.text_mode and not self.ids:
            # text, or a finished answer that never got as far as a call's name
            self.text_mode = result.kind == "text" or (finished and not result.calls)
        if self.text_mode:
            piece, self.sent_chars = text[self.sent_chars :], len(text)
            return [{"content": piece}] if piece else []
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(result.calls):
            if i == len(self.ids):
                self.ids.append(self.fmt.new_id())
                self.sent_args.append(0)
                head = {"index": i, "id": self.ids[i], "type": "function",
                        "function": {"name": call.name, "arguments": ""}}  # fmt: skip
                deltas.append({"tool_calls": [head]})
            piece = call.arguments[self.sent_args[i] :]
            if piece:
                self.sent_args[i] = len(call.arguments)
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
        return deltas


class ChatShaper(Protocol):
    """What the server's chat shaper offers the tool stream (backend/entrypoints/server.py)."""

    include_usage: bool

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]: ...
    def choice(
        self, delta: dict[str, Any], logprobs: dict | None = None, finish: str | None = None, index: int = 0
    ) -> dict: ...
    def logprobs(self, entries: list[dict] | None) -> dict[str, Any] | None: ...
    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]: ...


async def tool_chunks(
    shaper: ChatShaper, stream: RequestStream, fmt: ToolFormat
) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a streamed answer to a request that offered tools, each choice on its index."""
    cursors = Cursors()  # what each choice has sent (tokens for logprobs; started, done)
    deltas: dict[int, ToolDeltas] = {}
    held: dict[int, list[dict]] = {}  # logprobs not yet sent with a delta, per choice
    cursors[0].started = True  # the first choice's role goes out at once, before any token
    yield shaper.chunk(shaper.choice({"role": "assistant", "content": None}))
    async for out in stream:
        for c in out.outputs:
            cursor = cursors[c.index]
            if not cursor.started:
                cursor.started = True
                yield shaper.chunk(shaper.choice({"role": "assistant", "content": None}, index=c.index))
            if cursor.done:
                continue
            _, entries = cursor.advance(c)
            pending = held.setdefault(c.index, [])
            pending += entries or []
            cursor.done = c.finish_reason is not None
            for delta in deltas.setdefault(c.index, ToolDeltas(fmt)).feed(c.text, cursor.done):
                yield shaper.chunk(shaper.choice(delta, shaper.logprobs(pending or None), index=c.index))
                pending = held[c.index] = []
            if cursor.done:
                finish = _finish(c.text, c.finish_reason, fmt)
                yield shaper.chunk(shaper.choice({}, finish=finish, index=c.index))
        if out.finished and shaper.include_usage:
            yield shaper.usage_chunk(out)
