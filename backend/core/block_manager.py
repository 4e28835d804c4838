"""KV blocks: allocation, reference counts, and automatic prefix caching.

Each full block gets a chained hash of (parent hash, its token ids), rooted in the request's
cache salt and LoRA adapter, so a hash names a whole prefix: equal hashes mean equal tokens from
position 0 under the same weights, and different tenants (salts) or adapters never share a block.
sha256 makes a collision, and with it wrong K/V, practically impossible.

Blocks nobody uses sit in one free queue, front first out. A freed block that holds a hash stays
findable until it is taken from the front (evicted): freed blocks join the back, least recently
used first out, and a sequence's blocks join deepest first, so its tail goes before the prefix
other requests are more likely to share. Blocks without a hash join the front: they hold nothing
worth keeping.

With a sliding window on every layer (``window``), a running sequence gives back each block wholly
before the window of its next query: no later query reads it. Its table entry becomes ``FREED``
(positions keep their block index); the blocks of attention sinks (StreamingLLM) stay. The block
keeps its hash and joins the free queue like a finished sequence's block: its K/V are still right
for any sequence with the same prefix from position 0, which the chained hash guarantees. A lookup
still walks from block 0 and stops at the first miss, so once a freed early block is evicted, no
later block of that prefix is reused without it (a later block's hash never stands in for the
blocks before it).
With a second tier (``backend/core/kv_tier.py``), an evicted hashed block is handed to it instead of
dropped, and a prefix lookup that misses the pool goes on into the tier: each block found there is
loaded into a free pool block (taken like any other, so it may evict in turn) and reused as if it had
never left. Hits are counted per tier when a request is first admitted.
"""

from __future__ import annotations

from collections import OrderedDict

from cachegw.backend.core.kv_events import KVEventPublisher
from cachegw.backend.core.kv_tier import TIERS, KVOffload
from cachegw.backend.core.sequence import Sequence
from cachegw.protocol.kv_blocks import chain_hash, root_hash

FREED = -1  # a block-table entry whose block was given back (before the window)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def seq_root(seq: Sequence) -> bytes:
    """The chain's root of a sequence: its cache salt and LoRA adapter (``protocol/kv_blocks.py``)."""
    lora = seq.params.lora
    return root_hash(seq.cache_salt, None if lora is None else lora.digest)


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "origin")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.origin = "pool"  # the tier its K/V came from, until a request first reuses it


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window: int | None = None,
        sinks: int = 0,
        tier: KVOffload | None = None,
        kv_budget: int = 0,
        events: KVEventPublisher | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # every layer's sliding window, or None
        self.kept_blocks = cdiv(sinks, block_size)  # the blocks of the attention sinks stay
        self.kv_budget = kv_budget  # H2O: tokens of KV a sequence keeps past a step (0 = no eviction)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, tokens found in the cache
        self.tier = tier if enable_prefix_caching else None
        self.hits_by_tier = dict.fromkeys(TIERS, 0)  # tokens of prefix_hits, by where they were found
        self.events = events  # KV events (stored, removed) for routers: backend/core/kv_events.py

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
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            if len(tokens) != bs:
                raise ValueError("only full blocks are hashed")
            hashes.append(chain_hash(hashes[-1] if i else seq_root(seq), tokens))
        return hashes[index]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of the longest cached run of the seq's full blocks.

        The last token is always left to compute: its logits are needed to sample.
        """
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []  # prompt logprobs need every prompt position computed
        hits: list[int] = []
        loaded: list[int] = []  # blocks back from the tier: in the pool again, for the KV events
        for i in range((seq.num_tokens - 1) // self.block_size):
            h = self.block_hash(seq, i)
            block_id = self.cached.get(h)
            if block_id is None:
                block_id = self._load_from_tier(h, hits)
                if block_id is None:
                    break
                loaded.append(i)
            hits.append(block_id)
        if loaded and self.events is not None:
            self._publish_stored(seq, loaded)
        return hits

    def most_blocks_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of ``num_tokens`` holds at once, computed ``chunk`` at a time:
        with a window, the blocks from its window start to the end of its current chunk."""
        whole = cdiv(num_tokens, self.block_size)
        if self.kv_budget:  # H2O compacts back to the budget once a block's worth is over it
            return min(whole, cdiv(self.kv_budget + self.block_size + chunk, self.block_size))
        if self.window is None:
            return whole
        return min(whole, self.kept_blocks + cdiv(self.window + chunk, self.block_size) + 1)

    def _load_from_tier(self, block_hash: bytes, hits: list[int]) -> int | None:
        """A free pool block holding the tier's copy of ``block_hash`` (findable, unreferenced), or
        None: not in the tier, its copy failed to load, or no free block outside ``hits`` is left."""
        if self.tier is None or self.tier.where(block_hash) is None:
            return None
        taken = set(hits)
        block_id = next((b for b in self.free if b not in taken), None)
        if block_id is None:
            return None
        self._evict(block_id)
        origin = self.tier.load(block_hash, block_id)
        block = self.blocks[block_id]
        self.free.move_to_end(block_id)  # most recently used: the request about to run wants it
        if origin is None:
            self.free.move_to_end(block_id, last=False)  # holds nothing
            return None
        block.hash, block.origin = block_hash, origin
        self.cached[block_hash] = block_id
        return block_id

    def prefetch(self, seq: Sequence) -> None:
        """Ask the tier to bring the seq's prompt blocks the pool lacks closer (disk to RAM) while it
        waits for admission."""
        if self.tier is None or not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return
        n = (seq.num_tokens - 1) // self.block_size
        self.tier.prefetch(h for i in range(n) if (h := self.block_hash(seq, i)) not in self.cached)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, cdiv(seq.num_cached_slots + num_new_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Can a waiting seq start with ``cached`` reused and ``num_new_tokens`` computed?"""
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)  # they leave the free queue
        fresh = cdiv(len(cached) * self.block_size + num_new_tokens, self.block_size) - len(cached)
        return fresh + revived <= len(self.free)

    def allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> None:
        assert not seq.block_table, "allocate is for sequences without blocks"
        first = seq.num_cached_tokens < 0  # the request's first admission: its prefix-cache hit
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            if first:
                self.hits_by_tier[block.origin] += self.block_size
            block.origin = "pool"
        seq.num_computed_tokens = len(cached) * self.block_size
        if first:
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += seq.num_computed_tokens
        self.append_slots(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block())

    def can_fork(self, parent: Sequence) -> bool:
        """Is there a block for the copy of the parent's partly filled last block (if it has one)?"""
        return parent.num_cached_slots % self.block_size == 0 or bool(self.free)

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give ``child`` the parent's computed blocks: full ones shared (ref count + 1), a partly
        filled last one copied, since each sample writes its own tokens into its free slots.

        Returns (source, destination) of the block whose K/V the runner must copy, or None.
        """
        full = parent.num_cached_slots // self.block_size
        child.block_table = parent.block_table[:full]
        for block_id in child.block_table:
            if block_id != FREED:
                self.blocks[block_id].ref_count += 1
        child.num_computed_tokens = parent.num_computed_tokens
        child.kv_dropped = parent.kv_dropped
        child.key_scores = None if parent.key_scores is None else parent.key_scores.clone()
        if len(parent.block_table) == full:
            return None
        copy = self._take_free_block()
        child.block_table.append(copy)
        return parent.block_table[full], copy

    def take_blocks(self, count: int) -> list[int]:
        """``count`` blocks from the free queue, referenced once (a swapped-in sequence's)."""
        return [self._take_free_block() for _ in range(count)]

    def _take_free_block(self) -> int:
        block_id = next(iter(self.free))
        self._evict(block_id)
        del self.free[block_id]
        self.blocks[block_id].ref_count = 1
        return block_id

    def _evict(self, block_id: int) -> None:
        """Empty a free block: its prefix goes to the tier (if any) and can no longer be found here."""
        block = self.blocks[block_id]
        if block.hash is None:
            return
        if self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
            if self.events is not None:
                self.events.removed([block.hash])
            if self.tier is not None:
                self.tier.save(block.hash, block_id)
        block.hash, block.origin = None, "pool"

    def free_blocks(self, seq: Sequence) -> None:
        """Release the seq's blocks (deepest first) and reset it to nothing computed."""
        for block_id in reversed(seq.block_table):
            if block_id != FREED:
                self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.kv_dropped, seq.key_scores = 0, None

    def free_outside_window(self, seq: Sequence) -> int:
        """Give back the seq's blocks wholly before its next query's window; returns how many."""
        if self.window is None:
            return 0
        table = seq.block_table
        end = min(max(0, seq.num_computed_tokens - self.window + 1) // self.block_size, len(table))
        start = end
        # Freed entries run from the kept sink blocks on: scan back to the last freed one.
        while start > self.kept_blocks and table[start - 1] != FREED:
            start -= 1
        for i in range(start, end):
            self._release(table[i])
            table[i] = FREED
        return max(0, end - start)

    def hold(self, block_hash: bytes) -> int | None:
        """Take a reference on the findable block of ``block_hash`` (a pin's), or None if none is."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1
        return block_id

    def release(self, block_id: int) -> None:
        """Drop a reference taken by ``hold``: at none left, the block is evictable again."""
        self._release(block_id)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count < 0:
            raise RuntimeError(f"block {block_id} freed more often than taken")
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.hash is None:
                self.free.move_to_end(block_id, last=False)

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
        if not self.enable_prefix_caching or seq.kv_dropped:  # compacted blocks are not the prefix
            return
        stored: list[int] = []  # indexes of the blocks made findable now, for the KV events
        for i in range(seq.num_computed_tokens // self.block_size):
            if seq.block_table[i] == FREED:  # hashed before it was freed (or not worth hashing)
                continue
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            h = self.block_hash(seq, i)
            if h not in self.cached:  # else an identical block computed elsewhere already holds it
                block.hash = h
                self.cached[h] = block.block_id
                if self.tier is not None:
                    self.tier.filled(h, block.block_id)
                stored.append(i)
        if stored and self.events is not None:
            self._publish_stored(seq, stored)

    def _publish_stored(self, seq: Sequence, indexes: list[int]) -> None:
        """One BlockStored per run of consecutive blocks; a first block's parent is the salt's root
        digest, so a consumer can check the chain (and which salt it belongs to) with protocol/kv_blocks."""
        assert self.events is not None
        bs, hashes = self.block_size, seq.block_hashes
        runs: list[list[int]] = []
        for i in indexes:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            parent = hashes[first - 1] if first else seq_root(seq)
            tokens = list(seq.token_ids[first * bs : (last + 1) * bs])
            self.events.stored(hashes[first : last + 1], parent, tokens, bs)

    def hashed_by_recency(self) -> list[tuple[bytes, int]]:
        """``(hash, block id)`` of every findable block, most recently used first: those in use, then the
        free ones from the back of the eviction order."""
        in_use = [b for b in self.blocks if b.ref_count > 0]
        order = [*in_use, *(self.blocks[i] for i in reversed(self.free))]
        return [(b.hash, b.block_id) for b in order if b.hash and self.cached.get(b.hash) == b.block_id]

    def compact(self, seq: Sequence, kept: int) -> list[int] | None:
        """The table for the seq's first ``kept`` slots after H2O compaction: its first blocks, each
        unhashed (its rows are about to change, so it names no prefix any more), or a fresh block where
        another sequence shares it; the blocks after them released. None (table unchanged) when no
        block is free for such a copy. The caller moves the K/V rows before anything else runs."""
        n = cdiv(kept, self.block_size)
        old = seq.block_table
        shared = sum(1 for b in old[:n] if self.blocks[b].ref_count > 1)
        if shared > len(self.free) + sum(1 for b in old[n:] if self.blocks[b].ref_count == 1):
            return None
        for block_id in reversed(old[n:]):
            self._release(block_id)
        table = []
        for block_id in old[:n]:
            block = self.blocks[block_id]
            if block.ref_count > 1:
                self._release(block_id)
                block_id = self._take_free_block()
            elif block.hash is not None:
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                    if self.events is not None:  # routers must stop counting on it
                        self.events.removed([block.hash])
                block.hash = None
            table.append(block_id)
        seq.block_table = table
        return table

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix not in use; returns how many blocks were dropped."""
        dropped = 0
        for block_id in self.free:
            block = self.blocks[block_id]
            if block.hash is not None:
                if self.cached.pop(block.hash, None) is not None and self.events is not None:
                    self.events.removed([block.hash])
                block.hash = None
                dropped += 1
        return dropped
