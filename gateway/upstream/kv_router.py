"""``routing = "kv"``: the gateway's side of precise, load-aware prefix routing.

It follows each backend's KV events (``kv_feed.py`` into ``kv_index.py``) and load (``backend_load.py``).
For a miss it asks one backend for the prompt's token ids (``POST /tokenize``: the engine's own chat
template and tokenizer, vLLM's route too), hashes them as the engine does under the request's cache
salt (``protocol/kv_blocks.py``) and lets ``policies/kv_routing.py`` rank the candidates: expected
cached tokens minus a load penalty, ties in the rendezvous hash's order. With no candidate publishing
events, or no tokens (the tokenize call failed), the hash's order stands.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from cachegw.gateway.config import BackendSpec
from cachegw.gateway.upstream.backend_load import BackendLoad, server_root
from cachegw.gateway.upstream.kv_feed import EventFeed
from cachegw.gateway.upstream.kv_index import CachedPrefix, KvIndex
from cachegw.policies.kv_routing import KvCandidate, KvChoice, choose

log = logging.getLogger("cachegw.gateway")

TOKENIZE_TIMEOUT_S = 5.0
# What a prompt's tokens depend on: the rest of a body (sampling, stream...) is not sent to /tokenize.
_CHAT_FIELDS = ("model", "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format")
_COMPLETION_FIELDS = ("model", "prompt")


def tokenize_body(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    fields = _CHAT_FIELDS if endpoint == "chat" else _COMPLETION_FIELDS
    return {k: body[k] for k in fields if k in body and body[k] is not None}


class KvRouter:
    """The KV index, its feeds and the load readings of the configured backends; ``order`` per miss."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        headers: Callable[[str], Mapping[str, str]],
        specs: Sequence[BackendSpec],
        load_penalty: float,
        interval_s: float,
        tier_weight: float = 0.8,
    ) -> None:
        self.client, self.headers = client, headers
        self.index = KvIndex()
        self.load_penalty = load_penalty
        self.tier_weight = tier_weight
        self.feeds = [
            EventFeed(s.url, s.kv_events, s.kv_events_replay, self.index) for s in specs if s.kv_events
        ]
        self.load = BackendLoad(client, [s.url for s in specs], headers, interval_s)
        self.routes: Counter[str] = Counter()  # decisions by reason, read by the Prometheus collector
        self.decide_seconds = 0.0  # time spent in ``order`` (the /tokenize round trip most of it), summed
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(f.run(), name=f"cachegw-kv-events-{f.url}") for f in self.feeds]
        self._tasks.append(asyncio.create_task(self.load.run(), name="cachegw-backend-load"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def indexed_blocks(self) -> dict[str, int]:
        return {f.url: len(self.index.blocks(f.url).held) for f in self.feeds}

    def tiered_blocks(self) -> dict[str, int]:
        """Per backend, the blocks its KV tier holds (RAM, disk, Redis), as its events say."""
        return {f.url: len(self.index.blocks(f.url).tiered) for f in self.feeds}

    def lost(self) -> dict[str, int]:
        """Per backend, gaps in its events that dropped its entries (replays filled the others)."""
        return {f.url: f.rebuilds for f in self.feeds}

    async def tokens(self, url: str, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as ``url`` computes them, or None if it cannot say."""
        try:
            r = await self.client.post(
                f"{server_root(url)}/tokenize",
                json=tokenize_body(endpoint, body),
                headers=dict(self.headers(url)),
                timeout=TOKENIZE_TIMEOUT_S,
            )
            r.raise_for_status()
            tokens = r.json().get("tokens")
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("kv routing: %s could not tokenize (%s); the hash routes", url, exc)
            return None
        return tokens if isinstance(tokens, list) else None

    async def order(self, urls: list[str], endpoint: str, body: dict[str, Any], salt: str | None) -> KvChoice:
        """``urls`` (in the rendezvous hash's order) ranked by expected cached tokens net of load."""
        start = time.perf_counter()
        publishing = [u for u in urls if self.index.publishing(u)]
        tokens = await self.tokens(urls[0], endpoint, body) if publishing and len(urls) > 1 else None
        candidates = []
        for url in urls:
            cached = self.index.cached(url, tokens, salt) if tokens is not None else CachedPrefix(0, 0)
            candidates.append(
                KvCandidate(
                    url,
                    url in publishing and tokens is not None,
                    cached.tokens,
                    self.load.load.get(url, 0),
                    cached.tier_tokens,
                )
            )
        choice = choose(candidates, self.load_penalty, self.tier_weight)
        self.routes[choice.reason] += 1
        self.decide_seconds += time.perf_counter() - start
        return choice
