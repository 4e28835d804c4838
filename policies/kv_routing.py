"""``routing = "kv"``: the backend whose KV cache holds most of a request's prompt, net of its load.

Each candidate's score is the prompt tokens its KV events say it holds (the longest run of the
request's blocks from the first, as the engine itself would reuse them, in its pool or its KV tier;
a tier's tokens count ``tier_weight`` each, a load being cheaper than a recompute but not free)
minus ``load_penalty`` tokens per sequence it is running or queueing (read from its metrics). The
best score answers; ties keep the rendezvous hash's order, so with nothing cached anywhere and equal
loads a conversation still sticks to one backend. When no candidate publishes KV events the hash's
order stands as is.

Why a backend won is kept for the request log: ``prefix`` (it holds more of the prompt than the
hash's choice), ``load`` (the hash's choice was busier by more than its cached prefix was worth),
``hash`` (the hash's choice itself won, or nobody publishes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RouteReason = Literal["prefix", "load", "hash"]


@dataclass(frozen=True, slots=True)
class KvCandidate:
    url: str
    publishes: bool  # its KV events are followed (an unknown backend holds nothing we know of)
    cached_tokens: int  # prompt tokens it is expected to reuse (from its pool or its tier)
    load: int  # sequences running + waiting, from its last metrics read (0 when unknown)
    tier_tokens: int = 0  # of cached_tokens, those it would load from its KV tier (RAM, disk, Redis)


@dataclass(frozen=True, slots=True)
class KvChoice:
    order: list[str]  # the candidates, best first
    reason: RouteReason
    expected_cached_tokens: int  # of the first


def choose(candidates: list[KvCandidate], load_penalty: float, tier_weight: float = 1.0) -> KvChoice:
    """``candidates`` in the rendezvous hash's order, best first by score (a stable sort)."""
    if not candidates:
        return KvChoice([], "hash", 0)
    if not any(c.publishes for c in candidates):
        return KvChoice([c.url for c in candidates], "hash", 0)

    def score(c: KvCandidate) -> float:
        return c.cached_tokens - (1.0 - tier_weight) * c.tier_tokens - load_penalty * c.load

    ranked = sorted(candidates, key=score, reverse=True)
    best, hashed = ranked[0], candidates[0]
    if best is hashed:
        reason: RouteReason = "hash"
    elif best.cached_tokens > hashed.cached_tokens:
        reason = "prefix"
    else:
        reason = "load"
    return KvChoice([c.url for c in ranked], reason, best.cached_tokens)
