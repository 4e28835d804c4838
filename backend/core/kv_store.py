"""What a store of offloaded KV blocks offers the RAM tier: the local disk (``kv_disk.py``) and Redis
(``kv_redis.py``) both implement it, so RAM spills to either or both and a lookup that misses the pool
and RAM asks each in turn.

Blocks are keyed by their chained hash and stored in one self-describing format
(``kv_disk.encode``: model identity, dtype, shape, hash, crc32), so a store never hands back a block
another model, dtype or block shape wrote, nor a torn one: ``read`` returns None for those.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from cachegw.backend.core.kv_tier_events import TierEvents


class BlockStore(Protocol):
    """A place blocks outlive the pool and RAM. Thread-safe: the engine thread asks ``in``/``read``,
    the tier's worker thread writes and reads ahead."""

    name: str  # the tier label in metrics and hit counts ("disk", "redis")
    rejected: int  # blocks that failed the format or checksum checks
    errors: int  # failed operations (a store that cannot be reached): each one a miss, never an error
    events: TierEvents | None  # what it stores and drops, published as KV events (None: not published)

    def __contains__(self, block_hash: bytes) -> bool: ...

    def read(self, block_hash: bytes) -> torch.Tensor | None:
        """The block's K/V, or None when it is missing, unreadable or fails a check."""
        ...

    def write(self, block_hash: bytes, data: torch.Tensor, mtime: float | None = None) -> None:
        """Store a block (a no-op when it is there already). ``mtime``: the recency to give it (a
        shutdown writes its most recent blocks first, each stamped older than the one before)."""
        ...

    def held(self) -> Iterator[bytes]:
        """The hashes it holds now (read lazily: the start-up announcement of ``kv_tier_events``)."""
        ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def bytes(self) -> int: ...

    def close(self) -> None: ...
