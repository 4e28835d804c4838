"""OpenAI's ``POST /v1/embeddings`` body: the request model and its ``input`` read as a list of inputs.

Both servers parse it here: the engine to compute the embeddings, the gateway to cache each input on
its own. ``input`` is a string, a list of strings, a list of token ids, or a list of lists of token
ids; it is checked by hand rather than by a pydantic union so that every refusal names ``input`` (and
the item) the way OpenAI's does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cachegw.protocol.errors import ApiError
from cachegw.protocol.requests import validation_error

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request

# One input as the model sees it: text, or token ids.
EmbeddingInput = str | list[int]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: Any  # read by ``inputs``
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @property
    def base64(self) -> bool:
        return self.encoding_format == "base64"

    def inputs(self) -> list[EmbeddingInput]:
        """The inputs, one per embedding in the answer, in order (a 400 naming ``input`` otherwise)."""
        return embedding_inputs(self.input)


def _bad(message: str) -> ApiError:
    return ApiError(400, f"Invalid value for 'input': {message}", param="input")


def _token_ids(value: list[Any], where: str) -> list[int]:
    if not value:
        raise _bad(f"{where} is an empty list of token ids.")
    if not all(type(t) is int and t >= 0 for t in value):  # bool is an int subclass: not a token
        raise _bad(f"{where} must hold non-negative integer token ids only.")
    return value


def embedding_inputs(value: Any) -> list[EmbeddingInput]:
    """``input`` as a list of strings or token-id lists: never empty, no empty item, at most MAX_INPUTS."""
    if isinstance(value, str):
        if not value:
            raise _bad("'' is not a valid input: it must not be an empty string.")
        return [value]
    if not isinstance(value, list):
        raise _bad("expected a string, a list of strings, a list of token ids or a list of lists of them.")
    if not value:
        raise _bad("the list of inputs is empty.")
    if all(isinstance(t, int) for t in value):  # token ids (a bool among them is refused there)
        return [_token_ids(value, "input")]
    if len(value) > MAX_INPUTS:
        raise _bad(f"{len(value)} inputs were given; at most {MAX_INPUTS} are allowed per request.")
    out: list[EmbeddingInput] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise _bad(f"input[{i}] is an empty string; every input must have text.")
            out.append(item)
        elif isinstance(item, list):
            out.append(_token_ids(item, f"input[{i}]"))
        else:
            raise _bad(f"input[{i}] must be a string or a list of token ids.")
    if len({type(item) for item in out}) > 1:
        raise _bad("strings and token-id lists cannot be mixed in one request.")
    return out


def parse_embedding_request(raw: bytes) -> EmbeddingRequest:
    """The body, validated strictly (a string is not a number); ``input`` is checked by ``inputs``."""
    try:
        return EmbeddingRequest.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = err["loc"]
        if err["type"] == "json_invalid" or not loc:
            raise validation_error(exc) from None
        param = str(loc[0])
        if err["type"] == "missing":
            raise ApiError(400, f"Missing required parameter: '{param}'.", param=param) from None
        raise ApiError(400, f"Invalid value for '{param}': {err['msg']}.", param=param) from None
