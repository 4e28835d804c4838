"""Server-sent events as OpenAI streams use them, both ways: one JSON object per ``data:`` event,
``data: [DONE]`` last; and a splitter that reads another server's stream into whole events."""

from __future__ import annotations

import json
from typing import Any

from cachegw.protocol.errors import error_body

DONE = b"data: [DONE]\n\n"


def event(obj: dict[str, Any]) -> bytes:
    """One ``data:`` event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def error_event(message: str, code: str, type: str = "server_error") -> bytes:
    """An OpenAI-style error body as an event: what OpenAI sends when a stream fails."""
    return event(error_body(message, type, None, code))


def data_of(raw_event: bytes) -> bytes | None:
    """The data of one event (its ``data:`` lines joined by newlines, as the SSE spec says), else None."""
    lines = [line[5:] for line in raw_event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[1:] if line.startswith(b" ") else line for line in lines)


class EventSplitter:
    """Cuts a byte stream into events at blank lines, whatever the line endings: ``\\r\\n``, ``\\n`` or
    ``\\r``, all three allowed by the SSE spec (a CRLF-framed backend was held to its end before)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events ``chunk`` completes, each without its closing blank line."""
        data = self._buffer + chunk
        # a trailing \r may be the first half of a \r\n split across chunks: decide on it later
        held = b"\r" if data.endswith(b"\r") else b""
        data = data[: len(data) - len(held)].replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *events, rest = data.split(b"\n\n")
        self._buffer = rest + held
        return events

    def close(self) -> list[bytes]:
        """At the end of the stream: a held ``\r`` ends its line, so the events it completes."""
        self._buffer = self._buffer.replace(b"\r", b"\n")
        return self.feed(b"")

    @property
    def rest(self) -> bytes:
        """What came after the last complete event (a torn or unterminated last event)."""
        return self._buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
