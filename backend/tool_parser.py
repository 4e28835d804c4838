"""The text of tool calls in a model's output: how one is written, and reading calls back, also while
they are still being generated (for streams).

One format is implemented: Hermes', which Qwen2.5, Hermes 2/3 and the generic tool prompt use; each
call on its own lines, ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, several
calls one after another. The grammar (``backend/tools.py``) writes exactly this layout, so the reader
can follow it character by character: a call's name is known as soon as its closing quote is out,
and its arguments can be sent in pieces before the call is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes its calls: each one between ``open`` and ``close``, ``separator`` between."""

    name: str
    open: str
    close: str
    separator: str
    # the JSON around a call's arguments: HEAD + name + MID + arguments + "}"
    head: str = '{"name": "'
    mid: str = '", "arguments": '

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it (``arguments`` is the JSON text of the arguments)."""
        return f"{self.open}{self.head}{name}{self.mid}{arguments}}}{self.close}"


HERMES = ToolFormat("hermes", open="<tool_call>\n", close="\n</tool_call>", separator="\n")


@dataclass
class PartialCall:
    """A call read so far: its name is whole; its arguments may still grow (``complete`` False)."""

    name: str
    arguments: str
    complete: bool


@dataclass
class Scan:
    """What an output is so far: plain ``text``, ``calls``, or still ``undecided`` (a prefix of a call)."""

    kind: Literal["text", "calls", "undecided"]
    calls: list[PartialCall]
    well_formed: bool = True  # False: something other than calls after them


def _held(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _expect(text: str, pos: int, literal: str) -> int | None:
    """The position after ``literal`` at ``pos``; -1 if the text ends inside it; None if it differs."""
    rest = text[pos : pos + len(literal)]
    if rest == literal:
        return pos + len(literal)
    return -1 if literal.startswith(rest) else None


def scan(text: str, fmt: ToolFormat = HERMES) -> Scan:
    """Read the calls in ``text`` (an output so far, or whole)."""
    body = text.lstrip()
    if not body:
        return Scan("undecided", [])
    first = _expect(body, 0, fmt.open)
    if first is None:
        return Scan("text", [])
    calls: list[PartialCall] = []
    pos, tail = 0, "}" + fmt.close
    while pos < len(body):
        if calls:
            after_sep = _expect(body, pos, fmt.separator)
            if after_sep is None:
                return Scan("calls", calls, well_formed=False)
            if after_sep < 0:
                break
            pos = after_sep
        steps = [fmt.open, fmt.head]
        for literal in steps:
            nxt = _expect(body, pos, literal)
            if nxt is None:
                return Scan("calls" if calls else "text", calls, well_formed=False)
            if nxt < 0:
                return Scan("calls" if calls else "undecided", calls)
            pos = nxt
        name_end = body.find('"', pos)
        if name_end < 0:
            break
        name = body[pos:name_end]
        nxt = _expect(body, name_end, fmt.mid)
        if nxt is None:
            return Scan("calls", calls, well_formed=False)
        if nxt < 0:
            calls.append(PartialCall(name, "", False))
            break
        end = body.find(tail, nxt)
        if end < 0:
            rest = body[nxt:]
            calls.append(PartialCall(name, rest[: len(rest) - _held(rest, tail)], False))
            break
        calls.append(PartialCall(name, body[nxt:end], True))
        pos = end + len(tail)
    return Scan("calls" if calls or first >= 0 else "undecided", calls)


def whole_calls(text: str, fmt: ToolFormat = HERMES) -> list[PartialCall] | None:
    """The calls of a finished output when it is calls only, each complete with JSON arguments."""
    result = scan(text, fmt)
    if result.kind != "calls" or not result.well_formed or not result.calls:
        return None
    if not all(c.complete for c in result.calls):
        return None
    try:
        for c in result.calls:
            json.loads(c.arguments)
    except ValueError:
        return None
    return result.calls
