"""OpenAI's Responses API requests, and the chat completions request each one means.

The gateway serves ``POST /v1/responses`` through its chat pipeline: one cache for every API, so the
same question asked as a Response after a chat completion (or the other way) is a hit. The translation
is canonical: a Response that says what a chat request says becomes that chat body, field for field,
with nothing added (``input="Q"`` is ``messages=[{"role": "user", "content": "Q"}]``).

Input items follow the API: messages (``role`` + a string or content parts), ``function_call`` and
``function_call_output`` items (a tool turn), and ``reasoning`` items, which carry no text a chat
model reads and are dropped. Images, files and the hosted tools (web search, file search, computer
use) are refused with a 400 that names the field: the models served here read text.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from cachegw.protocol.errors import ApiError
from cachegw.protocol.requests import Seed


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextContent(_Model):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalContent(_Model):
    type: Literal["refusal"]
    refusal: str


Content = Annotated[TextContent | RefusalContent, Field(discriminator="type")]


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Content]

    def text(self) -> str | list[dict[str, str]]:
        """The content as chat carries it: a string, or text parts when there are several."""
        if isinstance(self.content, str):
            return self.content
        texts = [p.text if isinstance(p, TextContent) else p.refusal for p in self.content]
        if len(texts) == 1:
            return texts[0]
        return [{"type": "text", "text": t} for t in texts]


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextContent]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


class ReasoningItem(_Model):
    type: Literal["reasoning"]


def _item_kind(item: Any) -> str:
    if isinstance(item, dict):
        kind = item.get("type", "message")
        return kind if isinstance(kind, str) else ""
    return getattr(item, "type", "")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(_Model):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat(self) -> dict[str, Any]:
        fn = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": fn}


class NamedFunction(_Model):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def response_format(self) -> dict[str, Any] | None:
        """Chat's ``response_format`` for this format (None for plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if not self.name or self.schema_ is None:
            raise ApiError(
                400, "text.format of type json_schema needs a name and a schema.", param="text.format"
            )
        spec = {
            "name": self.name,
            "schema": self.schema_,
            "strict": self.strict,
            "description": self.description,
        }
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextConfig(_Model):
    format: TextFormat | None = None


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: Seed | None = None  # not OpenAI's; vLLM takes it
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = False
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    background: bool | None = None
    conversation: Any = None

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


# field names that may appear in a validation error's path (protocol.requests.parse_request)
FIELDS = frozenset(
    name
    for m in (
        ResponsesRequest,
        MessageItem,
        FunctionCallItem,
        FunctionCallOutputItem,
        FunctionTool,
        TextConfig,
    )
    for name in m.model_fields
) | {"schema", "format", "name"}


def check_supported(req: ResponsesRequest) -> None:
    """What this gateway cannot do, refused by name instead of ignored."""
    if req.background:
        raise ApiError(400, "background responses are not supported by this gateway.", param="background")
    if req.conversation is not None:
        raise ApiError(
            400, "conversation is not supported; chain turns with previous_response_id.", param="conversation"
        )


def chat_messages(
    instructions: str | None,
    items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem],
) -> list[dict[str, Any]]:
    """The conversation as chat messages: function calls join the assistant turn they follow."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)
                if not last.get("content"):
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def chat_body(
    req: ResponsesRequest,
    items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem],
) -> dict[str, Any]:
    """The chat completions body that asks what ``req`` asks, over the whole conversation ``items``
    (earlier turns of ``previous_response_id`` included). Only fields the request gave are set."""
    messages = chat_messages(req.instructions, items)
    if not messages:
        raise ApiError(400, "input must hold at least one message.", param="input")
    body: dict[str, Any] = {"messages": messages}
    if req.model is not None:
        body["model"] = req.model
    for ours, theirs in (("max_output_tokens", "max_tokens"),):
        if getattr(req, ours) is not None:
            body[theirs] = getattr(req, ours)
    for name in ("temperature", "top_p", "seed", "parallel_tool_calls", "user"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    for name in ("prompt_cache_key", "prompt_cache_retention"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.text is not None and req.text.format is not None:
        fmt = req.text.format.response_format()
        if fmt is not None:
            body["response_format"] = fmt
    if req.tools:
        body["tools"] = [t.chat() for t in req.tools]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    return body
