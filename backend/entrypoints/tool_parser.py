"""The text of tool calls in a model's output: how one is written, and reading calls back, also while
they are still being generated (for streams).

Three formats, each the one its models were trained on (and the one their chat templates show):

- Hermes' (Qwen2.5, Hermes 2/3, and the generic tool prompt): each call on its own lines,
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, several one after another;
- Llama 3.1+'s: the call as bare JSON, ``{"name": "f", "parameters": {...}}``, possibly after
  ``<|python_tag|>``; one call per answer, as Meta's template allows;
- Mistral's: ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]``, one list of calls.

The grammar (``tools.py``) writes exactly these layouts, so the reader follows them character
by character: a call's name is known as soon as its closing quote is out, and its arguments (read
as JSON, bracket by bracket) can be sent in pieces before the call is complete.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Literal

from cachegw.protocol.tool_calls import new_call_id

ID_ALPHABET = string.ascii_letters + string.digits  # of fixed-length call ids (Mistral's)


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes its calls: ``prefix``, then each call between ``open`` and ``close`` with
    ``separator`` between calls, then ``suffix``. A call is ``head`` + name + ``mid`` + arguments + "}"."""

    name: str
    open: str
    close: str
    separator: str
    head: str = '{"name": "'
    mid: str = '", "arguments": '
    prefix: str = ""
    suffix: str = ""
    lead: str = ""  # a marker the model may write first, or not (Llama's <|python_tag|>)
    parallel: bool = True  # whether one answer may hold several calls
    markers: tuple[str, ...] = ()  # parts of the layout that may be one special token of the tokenizer
    id_length: int = 0  # call ids the template insists on: this many letters and digits (0: OpenAI's)

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it (``arguments`` is the JSON text of the arguments)."""
        return f"{self.open}{self.head}{name}{self.mid}{arguments}}}{self.close}"

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """A whole answer of calls, (name, arguments JSON) each."""
        return self.prefix + self.separator.join(self.call_text(n, a) for n, a in calls) + self.suffix

    @property
    def text_excludes(self) -> str:
        """The first characters a text answer may not have (they could start a call)."""
        return "".join(sorted({(self.prefix + self.open + self.head)[0], *self.lead[:1]}))

    def new_id(self) -> str:
        """A fresh id for a call the model made."""
        if self.id_length:
            return "".join(secrets.choice(ID_ALPHABET) for _ in range(self.id_length))
        return new_call_id()


HERMES = ToolFormat("hermes", open="<tool_call>\n", close="\n</tool_call>", separator="\n")
LLAMA3 = ToolFormat(
    "llama3", open="", close="", separator="; ", mid='", "parameters": ', lead="<|python_tag|>",
    parallel=False,
)  # fmt: skip
MISTRAL = ToolFormat(
    "mistral", open="", close="", separator=", ", prefix="[TOOL_CALLS] [", suffix="]",
    markers=("[TOOL_CALLS]",), id_length=9,
)  # fmt: skip


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
    closed: bool = False  # the calls and the format's suffix are all out


def _expect(text: str, pos: int, literal: str) -> int | None:
    """The position after ``literal`` at ``pos``; -1 if the text ends inside it; None if it differs."""
    rest = text[pos : pos + len(literal)]
    if rest == literal:
        return pos + len(literal)
    return -1 if literal.startswith(rest) else None


def json_end(text: str, start: int) -> int:
    """The position after the JSON object or array that starts at ``start``; -1 while it is incomplete."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def scan(text: str, fmt: ToolFormat = HERMES) -> Scan:
    """Read the calls in ``text`` (an output so far, or whole)."""
    body = text.lstrip()
    if fmt.lead and body.startswith(fmt.lead):
        body = body[len(fmt.lead) :].lstrip()
    elif fmt.lead and fmt.lead.startswith(body):
        return Scan("undecided", [])
    if not body:
        return Scan("undecided", [])
    calls: list[PartialCall] = []
    pos = 0
    while True:
        if calls:  # after a whole call: the separator and another call, or the suffix and the end
            ended = _expect(body, pos, fmt.suffix)
            if ended is not None and (ended < 0 or (fmt.suffix and ended == len(body))):
                return Scan("calls", calls, closed=ended > 0)
            if ended == len(body):  # no suffix, and nothing after the call
                return Scan("calls", calls, closed=True)
        start = fmt.separator + fmt.open + fmt.head if calls else fmt.prefix + fmt.open + fmt.head
        nxt = _expect(body, pos, start)
        if nxt is None:  # not a call: text at the start, something else after calls
            return Scan("calls", calls, well_formed=False) if calls else Scan("text", [])
        if nxt < 0:
            return Scan("calls" if calls else "undecided", calls)
        name_end = body.find('"', nxt)
        if name_end < 0:
            return Scan("calls" if calls else "undecided", calls)
        name, args = body[nxt:name_end], _expect(body, name_end, fmt.mid)
        if args is None:
            return Scan("calls", calls, well_formed=False) if calls else Scan("text", [])
        if args < 0:
            calls.append(PartialCall(name, "", False))
            return Scan("calls", calls)
        end = json_end(body, args) if body[args : args + 1] in ("{", "[", "") else None
        if end is None:
            return Scan("calls", calls, well_formed=False)
        if end < 0:
            calls.append(PartialCall(name, body[args:], False))
            return Scan("calls", calls)
        after = _expect(body, end, "}" + fmt.close)
        calls.append(PartialCall(name, body[args:end], after is not None and after > 0))
        if after is None:
            return Scan("calls", calls, well_formed=False)
        if after < 0:
            return Scan("calls", calls)
        pos = after


def whole_calls(text: str, fmt: ToolFormat = HERMES) -> list[PartialCall] | None:
    """The calls of a finished output when it is calls only, each complete with JSON arguments."""
    result = scan(text, fmt)
    if result.kind != "calls" or not result.well_formed or not result.closed or not result.calls:
        return None
    if not all(c.complete for c in result.calls):
        return None
    try:
        for c in result.calls:
            json.loads(c.arguments)
    except ValueError:
        return None
    return result.calls
