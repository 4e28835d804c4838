"""The model runner on a tiny random-weight Llama (load_format "dummy"): KV-cache bookkeeping without the
real model. Chunked prefill, decode over the cache and batching must give the logits of one plain prefill."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from cachegw.backend.config import load_engine_config
from cachegw.backend.core.block_manager import BlockManager
from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.backend.core.scheduler import ScheduledBatch
from cachegw.backend.core.sequence import Sequence
from cachegw.backend.executor.model_runner import ModelRunner

BS = 4
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def runner():
    hf = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        architectures=["LlamaForCausalLM"],
    )
    cfg = load_engine_config(load_format="dummy", device="cpu", dtype="float32", block_size=BS)
    cfg = cfg.with_overrides(kv_cache_tokens=64)
    r = ModelRunner(cfg, hf, None, torch.device("cpu"), torch.float32, max_model_len=128)
    yield r
    del r


def logits_of(
    runner: ModelRunner, bm: BlockManager, chunks: list[list[tuple[Sequence, int]]]
) -> torch.Tensor:
    """Run the chunks in order (each a batch of (sequence, tokens)); the last batch's logits."""
    out = torch.empty(0)
    for batch in chunks:
        for s, n in batch:
            if s.block_table:
                bm.append_slots(s, n)
            else:
                bm.allocate(s, [], n)
        out = runner.execute(ScheduledBatch([s for s, _ in batch], [n for _, n in batch])).logits
        for s, n in batch:
            s.num_computed_tokens += n
    return out


def fresh(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


PROMPT = [5, 9, 2, 33, 17, 8, 40, 3, 11, 60, 21]


def test_kv_cache_is_sized_from_kv_cache_tokens(runner: ModelRunner) -> None:
    assert runner.num_blocks == 64 // BS and runner.attention_backend == "torch"
    k, v = runner.kv_caches[0]
    assert k.shape == v.shape == (16, BS, 2, 8) and len(runner.kv_caches) == 2


def test_chunked_prefill_and_decode_match_one_plain_prefill(runner: ModelRunner) -> None:
    bm = BlockManager(runner.num_blocks, BS, enable_prefix_caching=False)
    whole = fresh("w", PROMPT)
    ref = logits_of(runner, bm, [[(whole, len(PROMPT))]])
    bm.free_blocks(whole)
    chunked = fresh("c", PROMPT)
    got = logits_of(runner, bm, [[(chunked, 5)], [(chunked, 6)]])
    torch.testing.assert_close(got, ref, **TOL)
    bm.free_blocks(chunked)

    prefix = fresh("p", PROMPT[:-1])
    logits_of(runner, bm, [[(prefix, len(PROMPT) - 1)]])
    prefix.token_ids.append(PROMPT[-1])
    torch.testing.assert_close(logits_of(runner, bm, [[(prefix, 1)]]), ref, **TOL)
    bm.free_blocks(prefix)

    other = fresh("o", PROMPT[::-1])
    assert not torch.allclose(logits_of(runner, bm, [[(other, len(PROMPT))]]), ref, **TOL)
    bm.free_blocks(other)


def test_a_batch_gives_each_sequence_its_own_logits(runner: ModelRunner) -> None:
    bm = BlockManager(runner.num_blocks, BS, enable_prefix_caching=False)
    prompts = [PROMPT, [7, 7, 1, 2, 3], [50, 4]]
    alone = []
    for i, p in enumerate(prompts):
        s = fresh(f"a{i}", p)
        alone.append(logits_of(runner, bm, [[(s, len(p))]]))
        bm.free_blocks(s)
    seqs = [fresh(f"b{i}", p) for i, p in enumerate(prompts)]
    together = logits_of(runner, bm, [[(s, len(s.token_ids)) for s in seqs]])
    torch.testing.assert_close(together, torch.cat(alone), **TOL)


def test_a_partial_chunk_samples_nothing(runner: ModelRunner) -> None:
    bm = BlockManager(runner.num_blocks, BS, enable_prefix_caching=False)
    s = fresh("x", PROMPT)
    bm.allocate(s, [], 4)
    step = runner.execute(ScheduledBatch([s], [4]))
    logits, rows = step.logits, step.rows
    assert rows == [] and logits.shape == (0, 64)
