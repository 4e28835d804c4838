"""Which backend answers a miss when several serve its model.

A backend's prefix cache (the built-in engine, vLLM, SGLang) only reuses KV blocks it computed itself, so
requests that share a prompt prefix should reach the same backend. ``prefix`` routing keys each request by
the root of its conversation (the messages up to the first user message; for completions, the start of the
prompt) and orders the backends by rendezvous hashing on that key: every turn of a conversation, and every
request with the same system prompt and opening question, goes to the same backend, conversations spread
evenly, and adding or removing a backend moves only the keys it owned. A ``prompt_cache_key`` in the
request replaces the conversation root as the key (``routing_key``). ``round_robin`` spreads requests
with no affinity (for backends without a prefix cache); ``first`` sends everything to the first listed
backend that serves the model and uses the others only when it is down. ``kv`` starts from the ``prefix``
order and lets the backends' KV events and load reorder it (``policies/kv_routing.py``).

The candidates are the backends up: one the health probes marked down (``gateway/upstream/health.py``)
is left out before the policy orders them, so with ``prefix`` only the keys it owned move.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any, Literal

from cachegw.policies.canonicalize import without_volatile_note

RoutingMode = Literal["prefix", "round_robin", "first", "kv"]

# Completions have no message structure: the first characters of the prompt stand for its shared prefix
# (about 500 tokens: longer than a typical system preamble, short enough that different questions after a
# shared preamble still share the key only when the preamble is at least this long).
PROMPT_PREFIX_CHARS = 2048


def routing_key(endpoint: str, body: dict[str, Any]) -> str:
    """The part of a (canonicalized) request that later requests of the same conversation repeat.

    A client's ``prompt_cache_key`` (OpenAI's field) says which requests share a prefix: it is the key
    alone, so every conversation that gives it lands on one backend, whatever its first question."""
    cache_key = body.get("prompt_cache_key")
    if isinstance(cache_key, str) and cache_key:
        return json.dumps({"prompt_cache_key": cache_key}, ensure_ascii=False)
    if endpoint == "chat":
        root: list[Any] = []
        for message in body.get("messages") or []:
            if isinstance(message, dict) and message.get("role") == "user":
                # on the first turn it may carry the volatile note that later turns send without
                root.append({**message, "content": without_volatile_note(message.get("content"))})
                break
            root.append(message)
        material: Any = [body.get("tools"), root]
    else:
        prompt = body.get("prompt")
        material = prompt[:PROMPT_PREFIX_CHARS] if isinstance(prompt, str) else prompt
    return json.dumps(material, sort_keys=True, ensure_ascii=False, default=str)


def rendezvous(urls: list[str], key: str) -> list[str]:
    """``urls`` ordered by highest random weight for ``key``: stable, and even across keys."""

    def weight(url: str) -> bytes:
        return hashlib.blake2b(f"{url}\x00{key}".encode(), digest_size=8).digest()

    return sorted(urls, key=weight, reverse=True)


class Router:
    """Orders the candidate backends of one request; the first that accepts the connection answers."""

    def __init__(self, mode: RoutingMode) -> None:
        self.mode = mode
        self._turn = itertools.count()

    def order(self, urls: list[str], endpoint: str, body: dict[str, Any]) -> list[str]:
        if len(urls) <= 1 or self.mode == "first":
            return list(urls)
        if self.mode == "round_robin":
            start = next(self._turn) % len(urls)
            return urls[start:] + urls[:start]
        return rendezvous(urls, routing_key(endpoint, body))
