"""Strict JSON bodies of the gateway's own APIs (admin settings, feedback): as on the /v1 routes, a
wrong type is a 400 that names the field ("on" is not true, "0.5" not a number, "100" not an integer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from cachegw.protocol.errors import ApiError

M = TypeVar("M", bound=BaseModel)


class StrictBody(BaseModel):
    """Unknown fields are refused too: a misspelt one would otherwise be ignored without a word."""

    model_config = ConfigDict(extra="forbid", strict=True)


def dotted(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc)


def parse_body(
    model: type[M], body: Any, what: str, param_of: Callable[[tuple[int | str, ...]], str] = dotted
) -> M:
    """``body`` (already parsed JSON) as ``model``, or a 400 naming the first wrong field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"{what} must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = param_of(tuple(err["loc"]))
        if err["type"] == "missing":
            raise ApiError(400, f"Missing required parameter: '{param}'.", param=param) from None
        raise ApiError(400, f"Invalid value for '{param}': {err['msg']}.", param=param) from None
