"""Tool calling in the built-in engine: the request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` read into a typed record, and the grammar that enforces the choice.

The grammar is a Lark grammar for llguidance with each function's ``parameters`` embedded as a JSON
schema (``%json``), so every call the engine writes names a listed function and its arguments validate:

- ``required``: one or more calls (one with ``parallel_tool_calls`` false, under the generic prompt
  or in a format that allows one, as Llama 3.1's);
- a named function: exactly one call of it;
- ``auto``: either calls, or the answer ``response_format`` asks for: its JSON, or without one plain
  text that cannot start a call (not ``<`` for Hermes' format, ``{`` for Llama's, ``[`` for Mistral's);
- ``none``: the ``response_format`` alone, and the tools are left out of the prompt.

The call format (``tool_parser.py``) is written as it is; a marker that is one special token
in the model's tokenizer (Mistral's ``[TOOL_CALLS]``) is that token (``<[id]>``), as the model was trained.

Bad definitions (a name OpenAI would refuse, ``parameters`` that are not a JSON schema, a
``tool_choice`` naming no listed function) are a 400 naming the parameter.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from cachegw.backend.core.sampling_params import StructuredOutput
from cachegw.backend.core.structured import JSON_OPTIONS
from cachegw.backend.entrypoints.tool_parser import HERMES, ToolFormat
from cachegw.protocol.errors import ApiError

Mode = Literal["none", "auto", "required", "named"]
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDef(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


_TOOLS = TypeAdapter(list[ToolDef])
_CHOICE = TypeAdapter(Literal["none", "auto", "required"] | NamedChoice)


@dataclass(frozen=True)
class Function:
    """One callable function: its name, description and the JSON schema of its arguments."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request carries it (what chat templates expect)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tool calling."""

    functions: tuple[Function, ...]
    mode: Mode
    named: str | None  # the forced function when mode is "named"
    parallel: bool
    format: ToolFormat = HERMES
    templated: bool = False  # the model's own template renders the tools (else the generic prompt)
    special: tuple[tuple[str, int], ...] = ()  # the format's markers that are special tokens: (text, id)
    answers_json: bool = False  # a response_format asks for JSON when the answer is not calls

    @property
    def calls_possible(self) -> bool:
        return self.mode != "none"

    @property
    def several_calls(self) -> bool:
        """Whether one answer may hold several calls: with ``parallel_tool_calls`` (OpenAI's default)
        and a template that knows tools. Under the generic prompt one call per answer: SmolLM2 then
        repeats calls until max_tokens (bench/tool_calls.py has the figures)."""
        return self.parallel and self.templated and self.format.parallel

    def grammar(self, answer: StructuredOutput | None = None) -> StructuredOutput | None:
        """The constraint of this choice given the request's response_format ``answer`` (None: text):
        ``none`` is the answer's alone, ``auto`` calls or the answer, ``required``/named calls only."""
        if self.mode == "none":
            return answer
        return StructuredOutput.lark(tool_grammar(self, answer), answer)  # answer: checked even if unused


def _param(prefix: str, loc: tuple[int | str, ...]) -> str:
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in ("function-after", "literal['none','auto','required']", "NamedChoice"):
            out += f".{part}"
    return out


def _invalid(prefix: str, exc: ValidationError) -> ApiError:
    err = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
    param = _param(prefix, tuple(err["loc"]))
    return ApiError(400, f"Invalid value for '{param}': {err['msg']}.", param=param)


def _function(tool: ToolDef, index: int) -> Function:
    fn = tool.function
    parameters = {"type": "object", "properties": {}} if fn.parameters is None else fn.parameters
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as exc:
        param = f"tools[{index}].function.parameters"
        raise ApiError(400, f"Invalid schema in '{param}': {exc.message}.", param=param) from None
    return Function(fn.name, fn.description, parameters, bool(fn.strict))


def tool_request(extra: dict[str, Any]) -> ToolRequest | None:
    """The request's tool fields (from the chat request's extra fields) as a ToolRequest, or None
    without tools. Raises ApiError(400) naming the bad parameter."""
    tools, choice = extra.get("tools"), extra.get("tool_choice")
    parallel = extra.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "Invalid value for 'parallel_tool_calls': expected a boolean.",
                       param="parallel_tool_calls")  # fmt: skip
    try:
        parsed_choice = None if choice is None else _CHOICE.validate_python(choice, strict=True)
    except ValidationError as exc:
        raise _invalid("tool_choice", exc) from None
    if tools is None:
        if parsed_choice not in (None, "none"):
            raise ApiError(400, "Invalid value for 'tool_choice': 'tool_choice' is only allowed when "
                           "'tools' are specified.", param="tool_choice")  # fmt: skip
        return None
    try:
        defs = _TOOLS.validate_python(tools, strict=True)
    except ValidationError as exc:
        raise _invalid("tools", exc) from None
    if not defs:
        raise ApiError(400, "Invalid 'tools': empty array. Expected an array with minimum length 1.",
                       param="tools")  # fmt: skip
    functions = tuple(_function(t, i) for i, t in enumerate(defs))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ApiError(400, "Invalid 'tools': function names must be unique.", param="tools")
    if isinstance(parsed_choice, NamedChoice):
        name = parsed_choice.function.name
        if name not in names:
            raise ApiError(400, f"Invalid value for 'tool_choice': no function named {name!r} in 'tools'.",
                           param="tool_choice")  # fmt: skip
        return ToolRequest(functions, "named", name, parallel is not False)
    mode: Mode = parsed_choice or "auto"  # type: ignore[assignment]
    return ToolRequest(functions, mode, None, parallel is not False)


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _lark_text(text: str, special: dict[str, int]) -> str:
    """``text`` as Lark terminals: its special-token markers as ``<[id]>`` (the model writes those as
    the one token it was trained on, never spelled out), the rest as strings; "" when empty."""
    parts, pos = [], 0
    for marker in sorted(special, key=lambda m: text.find(m)):
        at = text.find(marker, pos)
        if at < 0:
            continue
        if at > pos:
            parts.append(_lark_string(text[pos:at]))
        parts.append(f"<[{special[marker]}]>")
        pos = at + len(marker)
    if pos < len(text):
        parts.append(_lark_string(text[pos:]))
    return " ".join(parts)


def _json_pieces(text: str) -> str:
    """JSON text as Lark strings cut where a JSON lexer cuts it (``{``, each string, ``: ``, ``, ``): where
    a call may also be the start of a JSON answer (Llama's bare calls), each piece is the very lexeme
    the answer's JSON would have there, and the parser, not the lexer, tells the two apart."""
    pieces = re.findall(r'"[^"]*"?|[^"]+', text)
    return " ".join(_lark_string(p) for p in pieces)


def schema_json(schema: dict[str, Any], strict: bool) -> str:
    """A JSON schema as %json text, with the engine's JSON layout and strictness."""
    guidance = {**JSON_OPTIONS, "lenient": not strict}
    return json.dumps({**schema, "x-guidance": guidance}, ensure_ascii=False)


def _answer_rule(answer: StructuredOutput | None, fmt: ToolFormat) -> str:
    """What ``auto`` allows besides calls: the response_format's JSON, else text that cannot start a call."""
    if answer is None or answer.kind == "lark":
        excluded = "".join("\\" + c if c in "[]\\^-/" else c for c in fmt.text_excludes)
        return f"answer: TEXT\nTEXT: /[^{excluded}\\s](.|\\n)*/"
    return f"answer: %json {schema_json(json.loads(answer.schema), answer.strict)}"


def tool_grammar(req: ToolRequest, answer: StructuredOutput | None = None) -> str:
    """The Lark grammar of the answers ``req`` allows (see the module docstring); under ``auto`` the
    answer that is not calls is ``answer`` (the response_format) when given, else plain text."""
    fmt, special = req.format, dict(req.special)
    rules: list[str] = []
    for i, fn in enumerate(req.functions):
        head = f"{_lark_text(fmt.open, special)} {_json_pieces(fmt.head + fn.name + fmt.mid)}"
        tail = _lark_text("}" + fmt.close, special)
        rules.append(f"f{i}: {head} %json {schema_json(fn.parameters, fn.strict)} {tail}")
    if req.mode == "named":
        rules.append(f"call: f{[f.name for f in req.functions].index(req.named or '')}")
    else:
        rules.append("call: " + " | ".join(f"f{i}" for i in range(len(req.functions))))
    more = f" ({_lark_text(fmt.separator, special)} call)*" if req.several_calls else ""
    rules.append(f"calls: {_lark_text(fmt.prefix, special)} call{more} {_lark_text(fmt.suffix, special)}")
    if req.mode == "auto":
        return "\n".join(["start: calls | answer", *rules, _answer_rule(answer, fmt)])
    return "\n".join(["start: calls", *rules])
