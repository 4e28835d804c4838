"""A prompt's KV handed from a prefill engine to a decode engine through the shared tier.

The prefill engine computes the prompt, then makes its full blocks durable in its disk/Redis stores
before it answers (``take_copies`` on the engine thread, ``store_copies`` off it): write-behind alone
would race, since its worker may still be writing when the decode engine looks. The decode engine's
prefix lookup then finds the blocks in the same stores by their chained hashes (salt and adapter
included, so tenants stay apart) and copies them into its pool instead of computing them.

Only the blocks a decode engine can reuse are handed over: the full blocks before the prompt's last
token (``BlockManager.find_cached_prefix`` always computes that token, for its logits). The decode
engine computes the rest: the partly filled last block, or the whole last block when the prompt fills
it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from cachegw.backend.core.kv_tier import KVOffload
from cachegw.protocol.kv_blocks import block_hashes

if TYPE_CHECKING:
    from cachegw.backend.core.block_manager import BlockManager
    from cachegw.backend.executor.model_runner import ModelRunner


def reusable_hashes(
    ids: Sequence[int], block_size: int, salt: str | None, adapter: str | None = None
) -> list[bytes]:
    """The chained hashes of the prompt's blocks another engine can reuse (all full blocks before its
    last token), first block first."""
    count = (len(ids) - 1) // block_size
    return list(block_hashes(ids[: count * block_size], block_size, salt, adapter))


def pooled_run(manager: BlockManager, hashes: Sequence[bytes]) -> int:
    """How many of ``hashes``, from the first, the pool holds. Read from another thread than the
    engine's: a dict lookup is atomic, and a block evicted meanwhile only makes the count stale."""
    held = manager.cached
    return next((i for i, h in enumerate(hashes) if h not in held), len(hashes))


def take_copies(
    manager: BlockManager, runner: ModelRunner, tier: KVOffload, hashes: Sequence[bytes]
) -> list[tuple[bytes, torch.Tensor]]:
    """Engine thread: host copies of the leading run of ``hashes`` found in the pool or the RAM tier
    (a block evicted since it was computed went there). Stops at the first block found nowhere: a
    lookup walks from the first block, so nothing after a gap could be reused."""
    copies = []
    for h in hashes:
        block_id = manager.cached.get(h)
        data = runner.read_block(block_id) if block_id is not None else tier.ram_copy(h)
        if data is None:
            break
        copies.append((h, data))
    return copies


def store_copies(tier: KVOffload, copies: Sequence[tuple[bytes, torch.Tensor]]) -> int:
    """Off the engine thread: write each block to every store that lacks it (a store skips a block it
    holds, so blocks written behind are not sent again); returns how many of them, from the first,
    a store now holds, which is what the decode engine will find."""
    for h, data in copies:
        for store in tier.stores:
            store.write(h, data)
    return next((i for i, (h, _) in enumerate(copies) if not any(h in s for s in tier.stores)), len(copies))
