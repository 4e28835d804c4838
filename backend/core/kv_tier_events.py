"""The KV tier's blocks as KV events, so a router counts what an engine can load back as well as what
its pool holds (``routing = "kv"`` weighs a tier's block below a pool block: a load costs something, a
recompute far more).

Each move is published under the tier's medium (``protocol/kv_events.TIER_MEDIUMS``), as vLLM's CPU
offloading publishes its own: hashes only, no parent, no token ids. A block evicted from the pool into
RAM is stored under "CPU" (and removed from the pool, "GPU"); loaded back, removed from "CPU" (and
stored in the pool again, by the block manager); written to disk or Redis, stored under "DISK" or
"REDIS"; dropped by the disk's budget, found torn or gone (an expired Redis key, on a lookup),
removed there. At start, after ``AllBlocksCleared``, the engine announces what its stores already hold
(the disk's index, the Redis keys under the model's prefix), so a router learns a restarted engine's
tier without waiting for a request. Not seen: a block another engine writes into a shared store later
(no store tells), until this engine looks it up or restarts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from cachegw.backend.config import EngineConfig
from cachegw.backend.core.kv_events import KVEventPublisher, publisher_for
from cachegw.protocol.kv_events import TIER_MEDIUMS

if TYPE_CHECKING:
    from cachegw.backend.core.kv_tier import KVOffload

log = logging.getLogger("cachegw.backend")

ANNOUNCE_BATCH = 256  # hashes per BlockStored in the start-up announcement
MAX_ANNOUNCED = 1_000_000  # blocks per store at most (32 MB of hashes); the rest is learned on lookups


class TierEvents:
    """The tier's side of the publisher: ``stored``/``removed`` by tier name, from any thread."""

    def __init__(self, publisher: KVEventPublisher, block_size: int) -> None:
        self.publisher = publisher
        self.block_size = block_size

    def stored(self, tier: str, hashes: Sequence[bytes]) -> None:
        if hashes:
            self.publisher.stored(hashes, None, [], self.block_size, TIER_MEDIUMS[tier])

    def removed(self, tier: str, hashes: Sequence[bytes]) -> None:
        if hashes:
            self.publisher.removed(hashes, TIER_MEDIUMS[tier])

    def announce(self, tier: str, hashes: Iterable[bytes]) -> int:
        """Publish what a store holds, in batches; returns how many blocks."""
        batch: list[bytes] = []
        n = 0
        for n, h in enumerate(hashes, 1):
            if n > MAX_ANNOUNCED:
                log.warning("kv events: %s holds over %d blocks; the rest are not announced", tier, n - 1)
                n -= 1
                break
            batch.append(h)
            if len(batch) == ANNOUNCE_BATCH:
                self.stored(tier, batch)
                batch = []
        self.stored(tier, batch)
        return n


def events_for(config: EngineConfig, tier: KVOffload | None) -> KVEventPublisher | None:
    """The engine's publisher (``kv_events.publisher_for``), with the tier's moves and, on the tier's
    worker thread, its stores' contents published too."""
    publisher = publisher_for(config)
    if publisher is not None and tier is not None:
        tier.attach_events(TierEvents(publisher, config.block_size))
    return publisher
