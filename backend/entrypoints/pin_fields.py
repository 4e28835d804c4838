"""A chat request's pins: ``cache_pins`` and OpenAI's ``prompt_cache_retention`` as the engine's
``PinRequest``s (``backend/core/pins.py``).

``cache_pins`` (the gateway's translation of Anthropic's ``cache_control`` breakpoints) lists up to
four ``{"messages": k, "ttl": seconds}``: keep the prompt prefix covering the first k messages (and
the tools, which templates render first) cached for ttl seconds. That prefix is found by rendering
the template for ``messages[:k]`` with the same tools and no generation prompt: its tokens' longest
common prefix with the prompt's (the engine rounds it down to whole blocks). k at or past the last
message pins the whole prompt. ``prompt_cache_retention`` pins the whole prompt: ``"in_memory"`` for
``[engine] pin_in_memory_ttl_s``, ``"24h"`` for a day, in the RAM/disk tier when there is one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cachegw.backend.config import EngineConfig
from cachegw.backend.core.pins import PinRequest
from cachegw.backend.entrypoints.tool_prompt import chat_prompt_ids
from cachegw.backend.entrypoints.tools import ToolRequest
from cachegw.protocol.errors import ApiError
from cachegw.protocol.requests import ChatCompletionRequest

MAX_PINS = 4  # Anthropic's limit on cache_control breakpoints
RETENTION_24H_S = 86400.0
RETENTIONS = ("in_memory", "24h")


@dataclass(frozen=True)
class PinAsk:
    """One pin as asked: the first ``messages`` messages, for ``ttl`` seconds."""

    messages: int
    ttl: float
    spill: bool = False


def _bad(param: str, why: str) -> ApiError:
    return ApiError(400, f"Invalid value for '{param}': {why}.", param=param, code="invalid_value")


def _entry(i: int, item: Any, max_ttl: float) -> PinAsk:
    param = f"cache_pins[{i}]"
    if not isinstance(item, dict):
        raise _bad(param, 'each entry is an object {"messages": k, "ttl": seconds}')
    extra = next((k for k in item if k not in ("messages", "ttl")), None)
    if extra is not None:
        raise _bad(f"{param}.{extra}", "an entry has only 'messages' and 'ttl'")
    k, ttl = item.get("messages"), item.get("ttl")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise _bad(f"{param}.messages", "must be an integer >= 1 (how many messages the prefix covers)")
    number = isinstance(ttl, int | float) and not isinstance(ttl, bool)
    if not isinstance(ttl, int | float) or not number or not math.isfinite(ttl) or not 0 < ttl <= max_ttl:
        raise _bad(f"{param}.ttl", f"must be a number of seconds above 0 and at most {max_ttl:g}")
    return PinAsk(k, float(ttl))


def requested_pins(req: ChatCompletionRequest, cfg: EngineConfig) -> list[PinAsk]:
    """The request's pins, validated; ApiError(400) naming the bad value."""
    extra = req.model_extra or {}
    asks: list[PinAsk] = []
    pins = extra.get("cache_pins")
    if pins is not None:
        if not isinstance(pins, list):
            raise _bad("cache_pins", 'must be a list of {"messages": k, "ttl": seconds}')
        if len(pins) > MAX_PINS:
            raise _bad("cache_pins", f"at most {MAX_PINS} entries")
        asks += [_entry(i, item, cfg.pin_max_ttl_s) for i, item in enumerate(pins)]
    retention = extra.get("prompt_cache_retention")
    if retention is not None:
        if retention not in RETENTIONS:
            raise _bad("prompt_cache_retention", "must be 'in_memory' or '24h'")
        whole = len(req.messages)
        asks.append(
            PinAsk(whole, cfg.pin_in_memory_ttl_s)
            if retention == "in_memory"
            else PinAsk(whole, RETENTION_24H_S, spill=True)
        )
    return asks


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pin_requests(
    tokenizer: Any, req: ChatCompletionRequest, tools: ToolRequest | None, ids: list[int], asks: list[PinAsk]
) -> tuple[PinRequest, ...]:
    """Each ask's prompt tokens (tokenizer thread). A prefix the template refuses to render alone
    (one ending where the template forbids) pins nothing."""
    out = []
    for ask in asks:
        if ask.messages >= len(req.messages):
            tokens = len(ids)
        else:
            try:
                prefix = chat_prompt_ids(tokenizer, req.messages[: ask.messages], tools, False)
            except ApiError:
                continue
            tokens = _common_prefix(prefix, ids)
        out.append(PinRequest(tokens, ask.ttl, ask.spill))
    return tuple(out)
