"""OpenAI request bodies: models, JSON parsing, and validation errors that name the field.

Requests are validated strictly (a string is not a number, a bool is not an int) so a wrong type
is a 400 that names the field, as OpenAI answers, instead of a silent coercion. Unknown fields
are ignored.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cachegw.protocol.errors import ApiError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

M = TypeVar("M", bound=BaseModel)


def _param_path(loc: tuple[int | str, ...], fields: frozenset[str]) -> str | None:
    """('messages', 0, 'content', 'str') -> 'messages[0].content': union branch tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in fields:
            out += f".{part}" if out else part
    return out or None


def validation_error(exc: ValidationError, fields: frozenset[str] | None = None) -> ApiError:
    """The first problem of a failed parse, in OpenAI's words where it has them.

    A union reports one error per branch; the deepest one says most (``content[0].type`` over
    "content should be a string").
    """
    errors = exc.errors(include_url=False)
    same_field = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
    err = max(same_field, key=lambda e: len(e["loc"]))
    kind, param = err["type"], _param_path(tuple(err["loc"]), fields or _FIELD_NAMES)
    if kind == "json_invalid":
        return ApiError(400, "We could not parse the JSON body of your request. Please send valid JSON.")
    if kind == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'.", param=param)
    if param is None:
        return ApiError(400, "The request body must be a JSON object.")
    return ApiError(400, f"Invalid value for '{param}': {err['msg']}.", param=param)


Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # what torch.Generator.manual_seed takes


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Model):
    include_usage: bool | None = False


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # checked so a wrong type is a 400; not templated

    def template_dict(self) -> dict[str, str]:
        """What the chat template sees; text parts are joined like vLLM does."""
        text = (
            self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or [])
        )
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class JsonSchemaFormat(_Model):
    """``response_format.json_schema``: the schema the output must validate against."""

    name: str = Field(min_length=1)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Model):
    """``response_format``. ``structural_tag`` is vLLM's: the gateway passes it on; the built-in engine
    refuses it."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object ({'name': ..., 'schema': ...})")
        return self


class GenerationRequest(_Model):
    """Fields both endpoints share. None means "not given" (clients may send explicit nulls)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # extension
    cache_salt: str | None = None  # extension (vLLM's name): isolates this tenant's prefix cache
    priority: int | None = None  # extension (vLLM's): lower is scheduled first; 0 the default
    # extension: a guess at the answer, the built-in engine's first source of speculative-decoding
    # drafts; it can make decoding faster or slower, never change the answer
    cachegw_draft: str | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None  # OpenAI's on chat; vLLM's extension on completions

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None

    def prompt_input(self) -> str | list[int]:
        """The one prompt: a string, token ids, or a list of one of them (as lm-eval sends ids)."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise ApiError(400, "Only one prompt per request is supported.", param="prompt")
            return self.prompt[0]  # type: ignore[return-value]
        return self.prompt  # type: ignore[return-value]

    def resolved_max_tokens(self) -> int:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
        if not self.logprobs:
            return None
        if not 0 <= (self.top_logprobs or 0) <= 20:
            raise ApiError(400, "top_logprobs must be between 0 and 20.", param="top_logprobs")
        return self.top_logprobs or 0

    def resolved_max_tokens(self, room: int) -> int:
        """max_completion_tokens, else max_tokens, else whatever room the context leaves.

        With no room left we still ask for one token, so the engine answers
        context_length_exceeded rather than a confusing "max_tokens must be >= 1".
        """
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        if self.max_tokens is not None:
            return self.max_tokens
        return max(1, room)


def _all_field_names(*models: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for m in models for name in m.model_fields)


_FIELD_NAMES = _all_field_names(
    CompletionRequest,
    ChatCompletionRequest,
    ChatMessage,
    TextPart,
    StreamOptions,
    ResponseFormat,
    JsonSchemaFormat,
) | {"schema"}


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def load_json(raw: bytes) -> Any:
    """``json.loads`` without what JSON does not allow but Python's parser accepts (NaN, Infinity) or
    cannot carry on (1e400 becomes inf): none of it could be sent on to a backend. Too deep a nesting
    is a 400 too, not a RecursionError."""
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:
        why = str(exc) if isinstance(exc, ValueError) else "it is nested too deeply"
        raise ApiError(400, f"We could not parse the JSON body of your request: {why}.") from None


def parse_request(model: type[M], raw: bytes, fields: frozenset[str] | None = None) -> M:
    """Parse and validate a JSON body; raises ApiError(400) for malformed JSON or bad fields.
    ``fields``: the names an error's parameter path may use (the chat and completions fields if None)."""
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise validation_error(exc, fields) from None
