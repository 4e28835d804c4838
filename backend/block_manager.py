"""KV blocks: allocation, reference counts, and automatic prefix caching.

Each full block gets a chained hash of (parent hash, its token ids), rooted in the request's
cache salt, so a hash names a whole prefix: equal hashes mean equal tokens from position 0, and
different tenants (salts) never share a block. sha256 makes a collision, and with it wrong
K/V, practically impossible.

Blocks nobody uses sit in one free queue, front first out. A freed block that holds a hash stays
findable until it is taken from the front (evicted): freed blocks join the back, least recently
used first out, and a sequence's blocks join deepest first, so its tail goes before the prefix
other requests are more likely to share. Blocks without a hash join the front: they hold nothing
worth keeping.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from backend.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, tokens found in the cache

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests."""
        return 1.0 - len(self.free) / len(self.blocks)

    def block_hash(self, seq: Sequence, index: int) -> bytes:
        """Chained hash of the seq's full block ``index`` (and of every block before it)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            parent = (
                hashes[-1] if i else hashlib.sha256(b"cachegw:" + (seq.cache_salt or "").encode()).digest()
            )
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            if len(tokens) != bs:
                raise ValueError("only full blocks are hashed")
            hashes.append(hashlib.sha256(parent + array("q", tokens).tobytes()).digest())
        return hashes[index]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of the longest cached run of the seq's full blocks.

        The last token is always left to compute: its logits are needed to sample.
        """
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []  # prompt logprobs need every prompt position computed
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.cached.get(self.block_hash(seq, i))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Can a waiting seq start with ``cached`` reused and ``num_new_tokens`` computed?"""
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)  # they leave the free queue
        fresh = cdiv(len(cached) * self.block_size + num_new_tokens, self.block_size) - len(cached)
        return fresh + revived <= len(self.free)

    def allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> None:
        assert not seq.block_table, "allocate is for sequences without blocks"
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(cached) * self.block_size
        self.append_slots(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block())

    def can_fork(self, parent: Sequence) -> bool:
        """Is there a block for the copy of the parent's partly filled last block (if it has one)?"""
        return parent.num_computed_tokens % self.block_size == 0 or bool(self.free)

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give ``child`` the parent's computed blocks: full ones shared (ref count + 1), a partly
        filled last one copied, since each sample writes its own tokens into its free slots.

        Returns (source, destination) of the block whose K/V the runner must copy, or None.
        """
        full = parent.num_computed_tokens // self.block_size
        child.block_table = parent.block_table[:full]
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1
        child.num_computed_tokens = parent.num_computed_tokens
        if len(parent.block_table) == full:
            return None
        copy = self._take_free_block()
        child.block_table.append(copy)
        return parent.block_table[full], copy

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: its prefix can no longer be found
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id

    def free_blocks(self, seq: Sequence) -> None:
        """Release the seq's blocks (deepest first) and reset it to nothing computed."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:
                    self.free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the seq's tokens: those only rejected draft tokens used. They
        were never hashed (only blocks of computed, accepted tokens are), so they join the front."""
        keep = cdiv(seq.num_tokens, self.block_size)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                assert block.hash is None, "a block of draft tokens was hashed"
                self.free[block.block_id] = None
                self.free.move_to_end(block.block_id, last=False)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Make every full block whose K/V are all computed findable, generated tokens included."""
        if not self.enable_prefix_caching:
            return
        for i in range(seq.num_computed_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            h = self.block_hash(seq, i)
            if h not in self.cached:  # else an identical block computed elsewhere already holds it
                block.hash = h
                self.cached[h] = block.block_id

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix not in use; returns how many blocks were dropped."""
        dropped = 0
        for block_id in self.free:
            block = self.blocks[block_id]
            if block.hash is not None:
                self.cached.pop(block.hash, None)
                block.hash = None
                dropped += 1
        return dropped
