"""Anthropic's Messages API as the gateway takes it: the request models, their translation into one
chat-completions body (the answer's shape is protocol/anthropic_answers.py).

The translation is canonical: what a chat client would send for the same conversation is what comes
out (one user string stays a string, text blocks are joined, no default is added: ``temperature``
only when given), so a Messages request and a chat completion share the gateway's cache entries.
``cache_control`` breakpoints become the engine extension ``cache_pins`` (the leading chat messages
each one covers, and how long to keep them); backends that cannot pin never see it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cachegw.protocol.errors import ApiError

MAX_BREAKPOINTS = 4  # Anthropic's limit on blocks with cache_control
_TTL_SECONDS = {"5m": 300, "1h": 3600}
_TEXT_ONLY = "the models served read text only"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Block(BaseModel):
    """Content blocks ignore fields they do not use (``citations``, ...): a client echoes them back."""

    model_config = ConfigDict(extra="ignore")


class CacheControl(_Model):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def seconds(self) -> int:
        return _TTL_SECONDS[self.ttl]


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ImageBlock(_Block):
    """Parsed only to be refused with a clear message (see ``_unsupported``)."""

    type: Literal["image", "document"]
    cache_control: CacheControl | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Model):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Model):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (web search, ...) are Anthropic's own
    cache_control: CacheControl | None = None


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("'name' is required with type 'tool' and only allowed there")
        return self


class Metadata(_Model):
    user_id: str | None = None


class Thinking(_Model):
    type: Literal["disabled"]  # the models served do not reason: only "disabled" is accepted


class MessagesRequest(_Model):
    """A ``POST /v1/messages`` body. Unknown fields are a 400 naming them: a feature that would change
    the answer is never dropped silently."""

    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None  # automatic caching: a breakpoint after the last message
    thinking: Thinking | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # billing on Anthropic's side: no-op


_FIELDS = frozenset(
    name
    for m in (MessagesRequest, Message, Tool, ToolChoice, Metadata, CacheControl, TextBlock)
    for name in m.model_fields
) | frozenset(f for m in (ToolUseBlock, ToolResultBlock, ImageBlock) for f in m.model_fields)


def _path(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'content', 'list[...]', 1, 'text', 'text') -> 'messages.0.content.1.text': the
    union branch ('list[...]') and the block's tag after its index ('text') are not fields."""
    parts: list[str] = []
    for i, p in enumerate(loc):
        tag = i >= 2 and isinstance(loc[i - 1], int) and "tagged-union" in str(loc[i - 2])
        if isinstance(p, int) or (p in _FIELDS and not tag):
            parts.append(str(p))
    return ".".join(parts)


def parse_messages_request(raw: bytes) -> MessagesRequest:
    """The body, validated strictly (a string is not a number); ApiError(400) naming the field."""
    try:
        return MessagesRequest.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
        err = max(first, key=lambda e: len(e["loc"]))
        if err["type"] == "json_invalid":
            raise ApiError(400, "The request body is not valid JSON.") from None
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            path = ".".join(x for x in (_path(loc[:-1]), str(loc[-1])) if x)
        else:
            path = _path(loc)
        msg = "Field required" if err["type"] == "missing" else err["msg"]
        if not path:
            raise ApiError(400, f"The request body must be a JSON object: {msg}.") from None
        raise ApiError(400, f"{path}: {msg}", param=path) from None


@dataclass
class _Pins:
    """Breakpoints as ``cache_pins``: the leading chat messages each covers, and for how long."""

    seen: list[tuple[int, int]] = field(default_factory=list)  # (messages, ttl seconds), in order

    def add(self, control: CacheControl | None, messages: int) -> None:
        if control is not None:
            self.seen.append((messages, control.seconds))

    def as_field(self) -> list[dict[str, int]]:
        """The pins, one per message count (the longest ttl asked for it); a 400 past Anthropic's limit."""
        if len(self.seen) > MAX_BREAKPOINTS:
            raise ApiError(
                400,
                f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                f"Found {len(self.seen)}.",
                param="cache_control",
            )
        ttl: dict[int, int] = {}
        for messages, seconds in self.seen:
            ttl[messages] = max(ttl.get(messages, 0), seconds)
        return [{"messages": k, "ttl": t} for k, t in sorted(ttl.items())]


def _joined(blocks: list[TextBlock]) -> str:
    """Text blocks as one string, joined as the engine's chat template joins text parts."""
    return "\n".join(b.text for b in blocks)


def _unsupported(block: ImageBlock, where: str) -> ApiError:
    return ApiError(400, f"{where}: {block.type} blocks are not supported: {_TEXT_ONLY}.", param=where)


def _tool_result(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if isinstance(part, ImageBlock):
                raise _unsupported(part, f"{where}.content.{j}")
        content = _joined([p for p in content if isinstance(p, TextBlock)])
    text = content or ""
    return f"Error: {text}" if block.is_error else text  # chat has no error flag: the model reads it


def _user(msg: Message, i: int, out: list[dict[str, Any]], pins: _Pins) -> None:
    """A user turn: each tool_result a ``tool`` message, each run of text blocks one user message."""
    if isinstance(msg.content, str):
        out.append({"role": "user", "content": msg.content})
        return
    texts: list[TextBlock] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": _joined(texts)})
            for t in texts:
                pins.add(t.cache_control, len(out))
            texts.clear()

    for j, block in enumerate(msg.content):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolResultBlock):
            flush()
            out.append(
                {"role": "tool", "tool_call_id": block.tool_use_id, "content": _tool_result(block, where)}
            )
            pins.add(block.cache_control, len(out))
        elif isinstance(block, ImageBlock):
            raise _unsupported(block, where)
        else:
            raise ApiError(400, f"{where}: tool_use blocks belong in assistant messages.", param=where)
    flush()
    if not msg.content:
        out.append({"role": "user", "content": ""})


def _assistant(msg: Message, i: int, out: list[dict[str, Any]], pins: _Pins) -> None:
    """An assistant turn: its text, and each tool_use a chat tool call (``arguments``: the JSON input)."""
    if isinstance(msg.content, str):
        out.append({"role": "assistant", "content": msg.content})
        return
    texts: list[TextBlock] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(msg.content):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
            )
        elif isinstance(block, ImageBlock):
            raise _unsupported(block, where)
        else:
            raise ApiError(400, f"{where}: tool_result blocks belong in user messages.", param=where)
    message: dict[str, Any] = {"role": "assistant", "content": _joined(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    out.append(message)
    for block in msg.content:
        pins.add(block.cache_control, len(out))


def _tool_choice(choice: ToolChoice) -> Any:
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def to_chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat-completions body that asks the same: only the fields the Messages request gives."""
    if req.messages[-1].role == "assistant":
        raise ApiError(
            400,
            "The last message must be a user message: a prefilled assistant reply is not supported.",
            param="messages",
        )
    pins = _Pins()
    messages: list[dict[str, Any]] = []
    system = req.system if isinstance(req.system, str) else "\n\n".join(b.text for b in req.system or [])
    if system:
        messages.append({"role": "system", "content": system})
    for block in req.system if isinstance(req.system, list) else []:
        pins.add(block.cache_control, 1)
    for tool in req.tools or []:
        pins.add(tool.cache_control, 1)  # the template renders tools with the first message
    for i, msg in enumerate(req.messages):
        (_user if msg.role == "user" else _assistant)(msg, i, messages, pins)
    pins.add(req.cache_control, len(messages))
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens}
    given = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stop": req.stop_sequences,
    }
    body |= {k: v for k, v in given.items() if v is not None}
    if req.tools:
        body["tools"] = [_chat_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
        if req.tool_choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.metadata is not None and req.metadata.user_id is not None:
        body["user"] = req.metadata.user_id
    if req.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if cache_pins := pins.as_field():
        body["cache_pins"] = cache_pins
    return body


def _chat_tool(tool: Tool) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        fn["description"] = tool.description
    fn["parameters"] = tool.input_schema
    return {"type": "function", "function": fn}
