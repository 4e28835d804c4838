"""Which backend holds which KV blocks, as their events tell (``routing = "kv"``).

Blocks are kept under the gateway's own chained hashes (``protocol/kv_blocks.py``), which the gateway
can compute for any request: the salt is the chain's root, so a tenant's request only ever matches
blocks computed under its own salt. The built-in engine's events carry those very hashes (a first
block's parent is the salt's root digest, which lets the chain be checked); another engine's (vLLM's)
are its own, so each of its blocks is re-hashed from its token ids and its parent's translation, and a
block whose parent is unknown (stored before we listened) is skipped. vLLM's first blocks name no
salt, so they are indexed unsalted: only requests without a salt match them.

Blocks in an engine's KV tier (any other medium: vLLM's CPU offloading and our RAM tier say "CPU", our
disk and Redis stores "DISK" and "REDIS") are kept apart from its pool's: such events carry hashes only
(no parent, no tokens), which are ours as they are, or vLLM's translated through the pool events that
named them first. A lookup walks pool and tier together, as the engine does, and says how many of the
tokens the tier would supply, which the router weighs below pool tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cachegw.protocol.kv_blocks import HASH_BYTES, block_hashes, chain_hash, root_hash
from cachegw.protocol.kv_events import (
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
)


@dataclass(slots=True)
class HeldBlocks:
    """One backend's blocks under our hashes, and its own hashes' translations (other engines)."""

    block_size: int = 0  # from its events; 0 until the first BlockStored
    held: set[bytes] = field(default_factory=set)  # in its pool
    tiered: dict[bytes, set[str]] = field(default_factory=dict)  # in its KV tier: hash -> mediums
    foreign: dict[BlockHash, bytes] = field(default_factory=dict)

    def clear(self) -> None:
        self.held.clear()
        self.tiered.clear()
        self.foreign.clear()

    def ours(self, h: BlockHash) -> bytes | None:
        """Our hash for one the engine named: its translation if foreign, else itself if it can be ours."""
        mapped = self.foreign.get(h)
        if mapped is not None:
            return mapped
        return h if isinstance(h, bytes) and len(h) == HASH_BYTES else None

    def forget_foreign(self, h: BlockHash, ours: bytes) -> None:
        """Drop a translation once no medium holds the block any more."""
        if ours not in self.held and ours not in self.tiered:
            self.foreign.pop(h, None)


class CachedPrefix(NamedTuple):
    tokens: int  # prompt tokens a backend would reuse, from its pool or its tier
    tier_tokens: int  # of those, the ones it would load from its tier


def _native(event: BlockStored) -> bool:
    """Does the event carry our chain (so its hashes need no translation)?"""
    parent, first = event.parent_block_hash, event.block_hashes[0]
    return (
        isinstance(parent, bytes)
        and len(parent) == HASH_BYTES
        and isinstance(first, bytes)
        and chain_hash(parent, event.token_ids[: event.block_size]) == first
    )


class KvIndex:
    """Per backend, the blocks its events say it holds; fed by ``gateway/upstream/kv_feed.py``."""

    def __init__(self) -> None:
        self._backends: dict[str, HeldBlocks] = {}

    def blocks(self, url: str) -> HeldBlocks:
        return self._backends.setdefault(url, HeldBlocks())

    def publishing(self, url: str) -> bool:
        """Has ``url`` told us its block size (so its holdings can be matched)?"""
        held = self._backends.get(url)
        return held is not None and held.block_size > 0

    def drop(self, url: str) -> None:
        """Forget what ``url`` holds (lost events that could not be replayed): rebuilt as events come."""
        self.blocks(url).clear()

    def apply(self, url: str, events: Iterable[KVEvent]) -> None:
        held = self.blocks(url)
        for event in events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif not event.block_hashes:
                continue
            elif event.medium not in (None, MEDIUM_POOL):
                self._tier(held, event)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    ours = held.ours(h)
                    if ours is not None:
                        held.held.discard(ours)
                        held.forget_foreign(h, ours)
            else:
                self._stored(held, event)

    @staticmethod
    def _tier(held: HeldBlocks, event: BlockStored | BlockRemoved) -> None:
        medium = event.medium or ""
        if isinstance(event, BlockStored) and event.block_size and not held.block_size:
            held.block_size = event.block_size
        for h in event.block_hashes:
            ours = held.ours(h)
            if ours is None:
                continue  # a foreign hash whose pool event we never saw: nothing to chain it to
            if isinstance(event, BlockStored):
                held.tiered.setdefault(ours, set()).add(medium)
                continue
            mediums = held.tiered.get(ours)
            if mediums is not None:
                mediums.discard(medium)
                if not mediums:
                    del held.tiered[ours]
            held.forget_foreign(h, ours)

    @staticmethod
    def _stored(held: HeldBlocks, event: BlockStored) -> None:
        bs = event.block_size
        held.block_size = bs
        if _native(event):
            held.held.update(h for h in event.block_hashes if isinstance(h, bytes))
            return
        parent = event.parent_block_hash
        ours = root_hash(None) if parent is None else held.foreign.get(parent)
        if ours is None:
            return  # its prefix was stored before we listened: nothing to chain it to
        for i, h in enumerate(event.block_hashes):
            tokens = event.token_ids[i * bs : (i + 1) * bs]
            if len(tokens) != bs:
                return
            ours = chain_hash(ours, tokens)
            held.foreign[h] = ours
            held.held.add(ours)

    def cached(self, url: str, tokens: Sequence[int], salt: str | None) -> CachedPrefix:
        """Prompt tokens ``url`` would reuse: its run of held blocks from the first, in its pool or its
        tier, as an engine looks them up (the last prompt token is always computed, so its block never
        counts); and how many of them its tier holds."""
        held = self._backends.get(url)
        if held is None or held.block_size == 0 or not (held.held or held.tiered):
            return CachedPrefix(0, 0)
        n = tier = 0
        for h in block_hashes(tokens[: max(0, len(tokens) - 1)], held.block_size, salt):
            if h not in held.held:
                if h not in held.tiered:
                    break
                tier += 1
            n += 1
        return CachedPrefix(n * held.block_size, tier * held.block_size)

    def cached_tokens(self, url: str, tokens: Sequence[int], salt: str | None) -> int:
        return self.cached(url, tokens, salt).tokens
