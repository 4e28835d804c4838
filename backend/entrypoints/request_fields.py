"""Which request fields the built-in engine honours: never a silent drop.

The shared request models (``protocol/requests.py``) ignore unknown fields, because the gateway
passes bodies on to backends that may honour them. The engine parses with the same models plus
``extra="allow"`` and answers every field it would otherwise drop: a field that cannot change the
output is accepted (``NO_OP``); a field it does not implement is accepted only with the value that
changes nothing (OpenAI's default, or null); anything else is a 400 naming the field. docs/engine.md
has the table, field by field.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict

from cachegw.protocol.errors import ApiError
from cachegw.protocol.requests import ChatCompletionRequest, CompletionRequest, GenerationRequest

# Accepted with any value: they label, store or bill the request on OpenAI's side, never change it.
NO_OP = frozenset(
    {"metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier"}
)

# Not implemented: accepted only with the value (besides null) that means "off", as (values, why).
_CHAT_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((), "the legacy function calling is not implemented: send 'tools'"),
    "function_call": (("none",), "the legacy function calling is not implemented: send 'tool_choice'"),
    "audio": ((), "the model outputs text only"),
    "modalities": ((["text"],), "the model outputs text only"),
    "prediction": ((), "predicted outputs are not implemented"),
    "web_search_options": ((), "there is no web search"),
    "reasoning_effort": ((), "the model does not reason"),
    "verbosity": ((), "the model has no verbosity setting"),
}
_COMPLETIONS_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((), "insertion (a suffix) is not implemented"),
}
CHAT_UNSUPPORTED = _CHAT_ONLY
# Honoured, but read from the extra fields (``tools.py``, ``pin_fields.py``) since the shared model does
# not carry them. prompt_cache_retention is honoured on chat (a pin) and a no-op on completions.
CHAT_HONOURED = frozenset(
    {"tools", "tool_choice", "parallel_tool_calls", "cache_pins", "prompt_cache_retention"}
)
COMPLETIONS_UNSUPPORTED = _COMPLETIONS_ONLY


class EngineCompletionRequest(CompletionRequest):
    """The shared model, keeping the fields it does not know so they can be answered."""

    model_config = ConfigDict(extra="allow")


class EngineChatRequest(ChatCompletionRequest):
    model_config = ConfigDict(extra="allow")


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    # True == 1 and 0 == False in Python, but JSON tells them apart (0 and 0.0 it does not).
    return value is None or any(isinstance(value, bool) is isinstance(v, bool) and value == v for v in off)


def check_fields(req: GenerationRequest) -> None:
    """Raise ApiError(400) naming the first field this engine would have to ignore."""
    chat = isinstance(req, ChatCompletionRequest)
    unsupported = CHAT_UNSUPPORTED if chat else COMPLETIONS_UNSUPPORTED
    for name, value in (req.model_extra or {}).items():
        if name in NO_OP or (chat and name in CHAT_HONOURED):
            continue
        rule = unsupported.get(name)
        if rule is None:
            raise ApiError(
                400, f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter"
            )
        off, why = rule
        if not _is_off(value, off):
            default = " or ".join(repr(v) for v in off) or "null"
            raise ApiError(
                400,
                f"The built-in engine does not support '{name}' ({why}): leave it out or send {default}.",
                param=name,
                code="unsupported_parameter",
            )
