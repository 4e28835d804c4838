"""Heavy-Hitter Oracle eviction (``[engine] kv_eviction = "h2o"``): which tokens it keeps, how it
compacts blocks, and on the real engine: a budget the sequence never reaches changes nothing, a small
one keeps a sequence's blocks bounded while it decodes on."""

from __future__ import annotations

import pytest
import torch

from cachegw.backend import LLM, SamplingParams
from cachegw.backend.core.block_manager import BlockManager, cdiv
from cachegw.backend.core.h2o import H2OEviction
from cachegw.backend.core.sequence import Sequence
from tests.test_engine_parity import DOC

BS = 4


def test_it_keeps_the_sinks_the_recent_window_and_the_heaviest_of_the_rest() -> None:
    h2o = H2OEviction(BlockManager(8, BS), lambda s, d: None, budget=6, recent=2, sinks=1)
    scores = torch.tensor([0.0, 5, 1, 9, 2, 7, 0, 3, 4])  # slots 0..8
    assert h2o.keep(scores).tolist() == [0, 1, 3, 5, 7, 8]  # the sink, the heavy 3, 5, 1, the recent 7, 8
    window = H2OEviction(BlockManager(8, BS), lambda s, d: None, budget=4, recent=4)
    assert window.keep(scores).tolist() == [5, 6, 7, 8]  # recent only: a sliding window


def test_compaction_moves_the_kept_rows_forward_frees_blocks_and_copies_a_shared_block() -> None:
    bm = BlockManager(8, BS)
    rows = torch.arange(8 * BS, dtype=torch.float32)  # one value per slot: where it came from

    def move(src: torch.Tensor, dst: torch.Tensor) -> None:
        rows[dst] = rows[src].clone()

    seq = Sequence("a", list(range(12)), SamplingParams())
    bm.allocate(seq, [], 12)
    seq.num_computed_tokens = 12
    bm.cache_computed_blocks(seq)  # 3 hashed full blocks
    other = Sequence("b", list(range(12)), SamplingParams())
    bm.allocate(other, bm.find_cached_prefix(other)[:1], 8)  # shares block 0 (ref 2)
    old = list(seq.block_table)
    seq.key_scores = torch.tensor([9.0, 0, 0, 8, 0, 0, 7, 0, 0, 0.5, 1, 1])
    h2o = H2OEviction(bm, move, budget=6, recent=2, sinks=1)
    h2o.after_step([seq], None)  # no scores this step: nothing happens
    assert seq.kv_dropped == 0
    h2o.after_step([seq], torch.zeros(1, 12))
    kept = [0, 3, 6, 9, 10, 11]  # the sink, the heavy 3, 6, 9, the recent 10, 11
    assert seq.kv_dropped == 6 and seq.num_cached_slots == 6 and len(seq.block_table) == 2
    assert seq.block_table[0] != old[0], "a block another sequence shares is copied, never rewritten"
    assert bm.blocks[old[0]].ref_count == 1 and bm.blocks[old[0]].hash is not None  # b's, still findable
    got = [int(rows[seq.block_table[i // BS] * BS + i % BS]) for i in range(6)]
    assert got == [old[k // BS] * BS + k % BS for k in kept]
    assert seq.key_scores.tolist() == [9.0, 8, 7, 0.5, 1, 1]
    assert all(bm.blocks[b].hash is None for b in seq.block_table), "compacted blocks name no prefix"
    assert bm.num_free_blocks == 8 - 2 - len(other.block_table)


@pytest.fixture(scope="module")
def h2o_llm() -> LLM:
    return LLM(
        dtype="float32",
        quantization="none",
        kv_cache_tokens=4096,
        max_num_batched_tokens=64,
        kv_eviction="h2o",
        kv_budget_tokens=64,
        compile="off",
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_a_budget_above_the_sequence_gives_full_attentions_tokens(h2o_llm: LLM) -> None:
    engine = h2o_llm.engine
    prompt = h2o_llm.chat_prompt_ids([{"role": "user", "content": "Name three primary colors."}])
    assert len(prompt) + 16 <= 64
    engine.block_manager.reset_prefix_cache()
    scored = h2o_llm.generate(prompt, greedy(16))[0].outputs[0].token_ids
    engine.runner.scores_keys, h2o = False, engine.h2o  # the plain attention path, nothing evicted
    engine.h2o = None
    try:
        engine.block_manager.reset_prefix_cache()
        plain = h2o_llm.generate(prompt, greedy(16))[0].outputs[0].token_ids
    finally:
        engine.runner.scores_keys, engine.h2o = True, h2o
    assert scored == plain and h2o is not None and h2o.evictions == 0


def test_a_small_budget_bounds_the_blocks_and_decoding_goes_on(h2o_llm: LLM) -> None:
    engine = h2o_llm.engine
    prompt = h2o_llm.chat_prompt_ids([{"role": "user", "content": f"{DOC}\nSummarize the text."}])
    assert len(prompt) > 3 * 64
    seq = engine.add_request("long", prompt, greedy(32))
    held, dropped = [], 0
    while engine.has_unfinished_requests():
        engine.step()
        if seq.num_output_tokens and not seq.is_finished:
            held.append(len(seq.block_table))
            dropped = seq.kv_dropped
    bs = engine.block_manager.block_size
    assert seq.num_output_tokens == 32 and dropped >= len(prompt) - 64 - bs
    assert max(held) <= cdiv(64 + bs, bs), "past the prompt, a sequence holds budget + one block at most"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    text = h2o_llm.tokenizer.decode(seq.output_token_ids)
    assert len(set(seq.output_token_ids)) > 5 and text.strip()
