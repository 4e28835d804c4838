"""The engine driven step by step for ``bench/preemption.py``: what recomputing ``L`` tokens adds to a
step that decodes a batch anyway, and a run under memory pressure with each resumed sequence's
latencies read off the steps (when it was preempted, re-admitted, and when its next token came), and
under recompute the share of a re-admitted sequence's tokens the prefix cache still held."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass


def prompt(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(length)]


def added_step_cost(engine, length: int, samples: int, rng: random.Random) -> float:
    """Seconds a prefill of ``length`` fresh tokens adds to a step decoding 4 other sequences: steps
    with and without it alternate, and the medians are subtracted."""
    from cachegw.backend import SamplingParams

    batch = [f"batch-{i}-{rng.random()}" for i in range(4)]
    for rid in batch:
        engine.add_request(rid, prompt(32, rng), SamplingParams(max_tokens=1000, ignore_eos=True))
    for _ in range(3):  # prefills done, decoding
        engine.step()
    plain, added = [], []
    for i in range(samples):
        t = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - t)
        engine.add_request(f"added-{i}-{rng.random()}", prompt(length, rng), SamplingParams(max_tokens=1))
        t = time.perf_counter()
        engine.step()
        added.append(time.perf_counter() - t)
    for rid in batch:
        engine.abort_request(rid)
    return statistics.median(added) - statistics.median(plain)


@dataclass
class Watch:
    """One sequence's latest preemption: when it happened and when it was re-admitted."""

    preempted_at: float | None = None
    resumed_at: float | None = None


def pressure_run(engine, length: int, requests: int, new: int, rng: random.Random) -> dict:
    """The requests at once in a pool that fits half of their prompts and one block more: decodes
    that cross a block boundary preempt the newest running sequence."""
    from cachegw.backend import SamplingParams
    from cachegw.backend.core.sequence import SequenceStatus

    bm = engine.block_manager
    bs = bm.block_size
    prompt_blocks = -(-length // bs)
    keep = max(-(-(length + new) // bs) + 1, max(1, requests // 2) * prompt_blocks + 1)
    held = bm.take_blocks(bm.num_free_blocks - keep)  # out of play for this run
    before = engine.stats()
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    tag = rng.random()
    seqs = [engine.add_request(f"p{i}-{tag}", prompt(length, rng), params) for i in range(requests)]
    reused, resumed_tokens = 0, 0  # recompute: what re-admissions found in the prefix cache
    allocate = bm.allocate

    def counted(seq, cached: list[int], n: int) -> None:
        nonlocal reused, resumed_tokens
        if seq.num_preemptions:
            reused += len(cached) * bs
            resumed_tokens += seq.num_tokens - 1
        allocate(seq, cached, n)

    bm.allocate = counted
    watch = {s: Watch() for s in seqs}
    ttft: list[float] = []  # re-admission -> next token
    stall: list[float] = []  # preemption -> next token
    t_start = time.perf_counter()
    while engine.has_unfinished_requests():
        state = {s: (s.status, s.num_preemptions, s.num_output_tokens) for s in seqs}
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        for s, (status, preemptions, outputs) in state.items():
            w = watch[s]
            if s.num_preemptions > preemptions:  # preempted in this step's schedule
                w.preempted_at, w.resumed_at = t0, None
            elif status is SequenceStatus.WAITING and preemptions and s.status is not SequenceStatus.WAITING:
                w.resumed_at = t0  # re-admitted in this step's schedule
            if s.num_output_tokens > outputs and w.resumed_at is not None and w.preempted_at is not None:
                ttft.append(t1 - w.resumed_at)
                stall.append(t1 - w.preempted_at)
                w.preempted_at = w.resumed_at = None
    wall = time.perf_counter() - t_start
    del bm.allocate
    for b in held:
        bm.release(b)
    after = engine.stats()
    preempted = [s for s in seqs if s.num_preemptions]
    e2e = [s.finish_time - s.arrival_time for s in preempted]
    return {
        "seconds": wall,
        "tokens_per_s": sum(s.num_output_tokens for s in seqs) / wall,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "swapped_out": after.swap.swapped_out - before.swap.swapped_out,
        "swapped_in": after.swap.swapped_in - before.swap.swapped_in,
        "preempted_requests": len(preempted),
        "resumes": len(ttft),
        "recompute_prefix_hit": reused / resumed_tokens if resumed_tokens else None,
        "resumed_ttft_s": statistics.mean(ttft) if ttft else None,
        "resumed_stall_s": statistics.mean(stall) if stall else None,
        "preempted_e2e_s": statistics.mean(e2e) if e2e else None,
        "all_e2e_s": statistics.mean(s.finish_time - s.arrival_time for s in seqs),
    }
