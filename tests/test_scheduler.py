"""The continuous-batching scheduler on a real block manager, stepping sequences by hand (no model)."""

from __future__ import annotations

from cachegw.backend.core.block_manager import BlockManager
from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.backend.core.scheduler import Scheduler
from cachegw.backend.core.sequence import Sequence, SequenceStatus

BS = 4


def make(num_blocks: int = 64, max_seqs: int = 8, budget: int = 32) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, enable_prefix_caching=False), max_seqs, budget)


def seq(rid: str, n_prompt: int) -> Sequence:
    return Sequence(rid, list(range(100, 100 + n_prompt)), SamplingParams())


def step(s: Scheduler) -> list[tuple[str, int]]:
    """Schedule once and 'run' the batch: computed tokens advance, a finished prompt gains a token."""
    batch = s.schedule()
    for q, n in zip(batch.seqs, batch.num_tokens, strict=True):
        q.num_computed_tokens += n
        if q.num_computed_tokens == q.num_tokens:
            q.token_ids.append(7)
    return [(q.request_id, n) for q, n in zip(batch.seqs, batch.num_tokens, strict=True)]


def test_long_prompt_is_chunked_by_the_token_budget() -> None:
    s = make(budget=16)
    a = seq("a", 40)
    s.add(a)
    assert step(s) == [("a", 16)]
    assert step(s) == [("a", 16)]
    assert step(s) == [("a", 8)]
    assert step(s) == [("a", 1)]  # now decoding
    assert a.status is SequenceStatus.RUNNING and not s.waiting


def test_decodes_go_first_and_waiting_join_in_arrival_order_within_budget() -> None:
    s = make(budget=20)
    s.add(seq("a", 6))
    assert step(s) == [("a", 6)]
    for rid, n in [("b", 12), ("c", 12)]:
        s.add(seq(rid, n))
    # a decodes (1), b's whole prompt (12), c gets the 7 left
    assert step(s) == [("a", 1), ("b", 12), ("c", 7)]
    batch = step(s)
    assert batch[:2] == [("a", 1), ("b", 1)] and batch[2] == ("c", 5)


def test_max_num_seqs_caps_the_running_set() -> None:
    s = make(max_seqs=2, budget=100)
    for rid in "abc":
        s.add(seq(rid, 3))
    assert [r for r, _ in step(s)] == ["a", "b"]
    assert [q.request_id for q in s.waiting] == ["c"]
    s.finish(s.running[0])
    assert [r for r, _ in step(s)] == ["b", "c"]


def test_newest_is_preempted_when_blocks_run_out_and_nothing_is_lost() -> None:
    s = make(num_blocks=4, budget=64)  # 16 token slots
    a, b = seq("a", 8), seq("b", 8)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 8), ("b", 8)]  # every block in use
    batch = s.schedule()  # a's next token needs a fifth block: b (newest) goes
    assert batch.num_preempted == 1 and [q.request_id for q in batch.seqs] == ["a"]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(s.waiting) == [b] and s.running == [a] and s.num_preemptions == 1
    ids = [q.request_id for q in (*s.waiting, *s.running)]
    assert sorted(ids) == ["a", "b"]  # each sequence in exactly one queue


def test_finish_frees_blocks_from_either_queue() -> None:
    s = make(num_blocks=8, max_seqs=1)
    a, b = seq("a", 8), seq("b", 8)
    s.add(a)
    s.add(b)
    step(s)
    free_before = s.block_manager.num_free_blocks
    s.finish(a)
    s.finish(b)
    assert a.status is b.status is SequenceStatus.FINISHED
    assert not s.has_unfinished()
    assert s.block_manager.num_free_blocks == free_before + 2 == 8


def pseq(rid: str, n_prompt: int, priority: int, arrival: float) -> Sequence:
    return Sequence(rid, list(range(100, 100 + n_prompt)), SamplingParams(priority=priority), None, arrival)


def test_a_high_priority_request_is_admitted_before_queued_low_priority_ones() -> None:
    """vLLM's meaning: lower value first. The later, more urgent request jumps the queue."""
    s = make(max_seqs=1, budget=100)
    s.add(pseq("running", 3, 0, 0.0))
    step(s)
    s.add(pseq("audit1", 3, 5, 1.0))
    s.add(pseq("audit2", 3, 5, 1.5))
    s.add(pseq("client", 3, 0, 2.0))
    assert [q.request_id for q in s.waiting] == ["client", "audit1", "audit2"]
    s.finish(s.running[0])
    assert step(s) == [("client", 3)]


def test_ageing_bounds_the_wait_of_a_low_priority_request() -> None:
    """Priority 5 at 1 s a level: passed by requests arriving less than 5 s after it, never by later ones."""
    s = make()
    s.add(pseq("low", 3, 5, 10.0))
    s.add(pseq("soon", 3, 0, 14.9))
    s.add(pseq("late", 3, 0, 15.1))
    assert [q.request_id for q in s.waiting] == ["soon", "low", "late"]


def test_the_lowest_priority_running_sequence_is_preempted_first() -> None:
    s = make(num_blocks=4, budget=64)  # 16 token slots
    low, high = pseq("low", 8, 3, 0.0), pseq("high", 8, 0, 1.0)
    s.add(low)
    s.add(high)
    assert sorted(step(s)) == [("high", 8), ("low", 8)]  # every block in use
    batch = s.schedule()  # the next token needs a fifth block: the older but lower-priority one goes
    assert [q.request_id for q in batch.seqs] == ["high"] and batch.num_preempted == 1
    assert list(s.waiting) == [low] and s.running == [high]


def test_ageing_protects_a_long_running_low_priority_sequence_from_preemption() -> None:
    """Priority 3 at 1 s a level: a priority-0 request arriving 5 s later is preempted instead."""
    s = make(num_blocks=4, budget=64)
    old, new = pseq("old", 8, 3, 0.0), pseq("new", 8, 0, 5.0)
    s.add(old)
    s.add(new)
    step(s)
    batch = s.schedule()
    assert [q.request_id for q in batch.seqs] == ["old"] and list(s.waiting) == [new]
