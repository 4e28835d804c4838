"""Block accounting, prefix hashing and eviction order, on the block manager alone."""

from __future__ import annotations

import pytest

from cachegw.backend.core.block_manager import BlockManager
from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.backend.core.sequence import Sequence

BS = 4


def seq(tokens: list[int], salt: str | None = None, rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), cache_salt=salt)


def run_to_completion(bm: BlockManager, s: Sequence) -> None:
    """Allocate every token of s, mark it computed, make its blocks findable."""
    cached = bm.find_cached_prefix(s)
    n = s.num_tokens - len(cached) * BS
    assert bm.can_allocate(s, cached, n)
    bm.allocate(s, cached, n)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)


def test_prefix_hit_is_whole_blocks_and_leaves_the_last_token():
    bm = BlockManager(16, BS)
    a = seq(list(range(10)))
    run_to_completion(bm, a)
    assert len(a.block_table) == 3 and len(bm.cached) == 2  # 10 tokens: two full blocks, one partial
    same = seq(list(range(10)), rid="b")
    assert len(bm.find_cached_prefix(same)) == 2
    exact = seq(list(range(8)), rid="c")  # both blocks cached, but the last token must be computed
    assert len(bm.find_cached_prefix(exact)) == 1
    diverge = seq([0, 1, 2, 3, 4, 99, 6, 7, 8], rid="d")
    assert len(bm.find_cached_prefix(diverge)) == 1
    assert bm.find_cached_prefix(seq(list(range(10)), salt="tenant-b", rid="e")) == []


def test_chained_hash_depends_on_the_whole_prefix():
    bm = BlockManager(16, BS)
    run_to_completion(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: the second block must not be found.
    other = seq([9, 9, 9, 9, 5, 6, 7, 8, 9], rid="x")
    assert bm.find_cached_prefix(other) == []


def test_free_returns_every_block_and_refcounts_never_go_negative():
    bm = BlockManager(8, BS)
    a, b = seq(list(range(9)), rid="a"), seq(list(range(9)), rid="b")
    run_to_completion(bm, a)
    run_to_completion(bm, b)  # shares a's two full blocks
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert [bm.blocks[i].ref_count for i in shared] == [2, 2]
    bm.free_blocks(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    bm.free_blocks(b)
    assert bm.num_free_blocks == 8
    assert all(block.ref_count == 0 for block in bm.blocks)
    b.block_table = shared  # a double free must be caught, never silently wrap
    with pytest.raises(RuntimeError):
        bm.free_blocks(b)


def test_eviction_is_lru_and_deepest_block_first():
    bm = BlockManager(5, BS)
    a = seq(list(range(12)), rid="a")  # 3 full blocks
    b = seq(list(range(100, 108)), rid="b")  # 2 full blocks
    run_to_completion(bm, a)
    run_to_completion(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free_blocks(a)  # freed first: least recently used
    bm.free_blocks(b)
    assert len(bm.cached) == 5 and bm.num_free_blocks == 5
    evicted = []
    for _ in range(5):
        before = set(bm.cached.values())
        bm._take_free_block()
        evicted.extend(before - set(bm.cached.values()))
    assert evicted == [a_blocks[2], a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]


def test_a_hit_revives_a_free_block_and_protects_it():
    bm = BlockManager(4, BS)
    a = seq(list(range(8)), rid="a")
    run_to_completion(bm, a)
    bm.free_blocks(a)
    again = seq(list(range(9)), rid="b")
    cached = bm.find_cached_prefix(again)
    assert len(cached) == 2
    bm.allocate(again, cached, 1)
    assert again.num_computed_tokens == 8
    assert bm.num_free_blocks == 1  # two revived, one fresh
    for block_id in cached:
        assert bm.blocks[block_id].ref_count == 1 and block_id not in bm.free


def test_unhashed_blocks_are_reused_before_cached_ones():
    bm = BlockManager(4, BS)
    a = seq(list(range(6)), rid="a")  # one full block (hashed) and one partial (not)
    run_to_completion(bm, a)
    full, partial = a.block_table
    bm.free_blocks(a)
    assert next(iter(bm.free)) == partial
    assert list(bm.free)[-1] == full


def test_prefix_caching_off_finds_nothing():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    run_to_completion(bm, seq(list(range(9))))
    assert bm.find_cached_prefix(seq(list(range(9)), rid="b")) == [] and not bm.cached


def test_reset_prefix_cache_forgets_free_blocks_but_not_used_ones():
    bm = BlockManager(8, BS)
    kept, freed = seq(list(range(9)), rid="kept"), seq(list(range(50, 59)), rid="freed")
    run_to_completion(bm, kept)
    run_to_completion(bm, freed)
    bm.free_blocks(freed)
    assert bm.reset_prefix_cache() == 2  # the freed sequence's two full blocks
    assert bm.find_cached_prefix(seq(list(range(50, 59)), rid="again")) == []
    assert len(bm.find_cached_prefix(seq(list(range(9)), rid="again2"))) == 2  # still in use: kept


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    """n > 1: the samples share the prompt's full blocks (ref counts) and each writes into its own
    copy of a partly filled last block; freeing them all returns every block."""
    bm = BlockManager(8, BS)
    parent = seq(list(range(10)))  # two full blocks and a partial one
    run_to_completion(bm, parent)
    child = seq(list(range(10)), rid="r")
    assert bm.can_fork(parent)
    src, dst = bm.fork(parent, child)  # type: ignore[misc]
    assert child.block_table[:2] == parent.block_table[:2]
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2, 1]
    assert src == parent.block_table[2] and dst == child.block_table[2] and dst != src
    assert child.num_computed_tokens == 10 and bm.num_free_blocks == 8 - 4
    for s in (parent, child):
        bm.free_blocks(s)
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_fork_at_a_block_boundary_copies_nothing():
    bm = BlockManager(2, BS)
    parent = seq(list(range(8)))
    run_to_completion(bm, parent)
    assert bm.num_free_blocks == 0 and bm.can_fork(parent)  # nothing to copy, so no block needed
    child = seq(list(range(8)))
    assert bm.fork(parent, child) is None
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    partial = seq(list(range(6)), rid="p")
    bm2 = BlockManager(2, BS)
    run_to_completion(bm2, partial)
    assert not bm2.can_fork(partial)  # its partial block needs a copy and no block is free
