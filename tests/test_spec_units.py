"""Speculative decoding's parts alone: the draft proposals, the verification rule (greedy and the
rejection sampler, checked statistically on a four-token vocabulary) and the blocks given back."""

from __future__ import annotations

import pytest
import torch

from cachegw.backend.core.block_manager import BlockManager
from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.backend.core.scheduler import Scheduler
from cachegw.backend.core.sequence import Sequence, SequenceStatus
from cachegw.backend.core.spec_verify import _rejection_sample, verify
from cachegw.backend.core.speculative import DraftSource
from cachegw.backend.executor.sampler import sample


def source(draft: list[int] | None = None, k: int = 3) -> DraftSource:
    return DraftSource(k, 1, 3, draft)


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 2, 3]  # "2 3" occurs twice before the tail: latest wins
    assert source().propose(tokens, 5, 3) == [7, 8, 6]
    assert source().propose(tokens, 5, 2) == [7, 8]  # room left by max_tokens or the step's budget
    assert source().propose([5, 6, 7, 8], 2, 3) == []  # nothing repeats
    assert source().propose(tokens, 5, 0) == []


def test_the_longest_matching_tail_is_tried_first() -> None:
    # The 1-gram "3" last occurred before 9, but the 2-gram "2 3" before 4.
    tokens = [2, 3, 4, 4, 4, 3, 9, 2, 3]
    assert source().propose(tokens, 0, 2) == [4, 4]


def test_a_repeating_tail_is_continued_with_its_period() -> None:
    assert source(k=4).propose([9, 7, 7, 7], 1, 4) == [7, 7, 7, 7]
    assert source(k=5).propose([5, 1, 2, 1, 2, 1], 1, 5) == [2, 1, 2, 1, 2]


def test_the_index_follows_a_growing_sequence() -> None:
    s, tokens = source(), [1, 2, 3, 1]
    assert s.propose(tokens, 0, 3) == [2, 3, 1]
    tokens += [2, 3, 9, 1, 2]
    assert s.propose(tokens, 0, 3) == [3, 9, 1]


def test_a_request_draft_is_followed_while_the_output_matches_it_then_realigned() -> None:
    prompt = [50, 51, 52]
    s = source(draft=[10, 11, 12, 13, 14, 15, 16])
    assert s.propose(prompt + [10], 3, 3) == [11, 12, 13]
    assert s.propose(prompt + [10, 11, 12, 13, 14, 15, 16], 3, 3) != [17]  # draft used up: own tokens
    # The output left the draft at 99, then said 13 again: the draft resumes after its 13.
    assert s.propose(prompt + [10, 11, 99, 13], 3, 3) == [14, 15, 16]
    # Nothing of the draft matches: prompt lookup over the sequence itself.
    assert s.propose(prompt + [50, 51, 52, 77, 50], 3, 2) == [51, 52]


def seq(params: SamplingParams, output: list[int] | None = None) -> Sequence:
    s = Sequence("r", [0, 1], params)
    s.token_ids += output or []
    return s


def test_greedy_verification_keeps_the_drafts_that_are_each_rows_argmax() -> None:
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 3, 1, 4]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0.0, max_tokens=9)
    out = verify(logits.clone(), seq(greedy), [2, 3, 5], torch.Generator())
    assert out.token_ids == [2, 3, 1] and out.accepted == 2  # 5 refused: row 2's own argmax instead
    out = verify(logits.clone(), seq(greedy), [2, 3, 1], torch.Generator())
    assert out.token_ids == [2, 3, 1, 4] and out.accepted == 3  # all accepted: one more for free


def test_greedy_verification_counts_accepted_drafts_in_the_penalties() -> None:
    """Row j is penalized as if the draft's first j tokens were generated, as a plain step would be."""
    logits = torch.zeros(3, 6)
    logits[:, 2] = 1.0
    logits[:, 3] = 0.5
    params = SamplingParams(temperature=0.0, max_tokens=9, frequency_penalty=0.8)
    out = verify(logits.clone(), seq(params), [2, 2], torch.Generator())
    # Row 1 already counts one 2 (1.0 - 0.8 < 0.5): it picks 3, as sample() would after that token.
    plain = sample(logits[1:2].clone(), [seq(params, [2])], torch.Generator()).token_ids[0]
    assert out.token_ids == [2, plain] == [2, 3]


def test_verification_reports_the_models_logprobs_of_each_kept_token() -> None:
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))
    draft = logits[:2].argmax(-1).tolist()
    out = verify(logits.clone(), seq(SamplingParams(temperature=0.0, logprobs=2)), draft, torch.Generator())
    assert len(out.logprobs) == 3
    for row, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert entry is not None and entry["token_id"] == token and len(entry["top"]) == 2
        assert entry["logprob"] == pytest.approx(float(logits[row].log_softmax(-1)[token]))


P0 = [0.3, 0.4, 0.2, 0.1]
P1 = [0.1, 0.1, 0.7, 0.1]


@pytest.mark.parametrize("draft", [[0, 2], [3, 2], [1, 1]])
def test_rejection_sampling_emits_tokens_distributed_as_without_drafts(draft: list[int]) -> None:
    """First emitted token ~ p0 whatever the draft; after an accepted first draft token, the next ~ p1."""
    probs = torch.tensor([P0, P1, P1])
    gen, n = torch.Generator().manual_seed(11), 5000
    firsts, seconds = torch.zeros(4), torch.zeros(4)
    for _ in range(n):
        tokens = _rejection_sample(probs, draft, gen)
        firsts[tokens[0]] += 1
        if tokens[0] == draft[0]:
            seconds[tokens[1]] += 1
    assert torch.allclose(firsts / n, torch.tensor(P0), atol=0.028)  # 4 sigma at p = 0.4
    assert torch.allclose(seconds / seconds.sum(), torch.tensor(P1), atol=0.05)


def test_sampled_verification_draws_from_the_temperature_scaled_distribution() -> None:
    """verify() hands the rejection sampler the distribution sample() draws from (temperature 0.5)."""
    logits = torch.log(torch.tensor([P0, P1]))
    params = SamplingParams(temperature=0.5, max_tokens=9)
    expected = torch.tensor(P0) ** 2 / (torch.tensor(P0) ** 2).sum()
    gen, n, counts = torch.Generator().manual_seed(5), 800, torch.zeros(4)
    for _ in range(n):
        counts[verify(logits.clone(), seq(params), [1], gen).token_ids[0]] += 1
    assert torch.allclose(counts / n, expected, atol=0.06)  # P0 itself is 0.13 away


def test_a_draft_token_outside_top_p_is_never_accepted() -> None:
    logits = torch.log(torch.tensor([P1, P1]))
    params = SamplingParams(temperature=1.0, top_p=0.5, max_tokens=9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        out = verify(logits.clone(), seq(params), [0], gen)
        assert out.token_ids == [2] and out.accepted == 0  # the nucleus holds token 2 alone


def test_trim_gives_back_the_blocks_only_rejected_drafts_used() -> None:
    bm = BlockManager(8, 4)
    s = Sequence("r", list(range(6)), SamplingParams())
    bm.allocate(s, [], 6)
    s.num_computed_tokens = 5  # the last token waits for its decode
    bm.append_slots(s, 1 + 4)  # it and four drafts: positions 5..9, three blocks
    assert len(s.block_table) == 3
    s.token_ids += [6]  # nothing accepted: the model's own token only
    s.num_computed_tokens = 6
    bm.cache_computed_blocks(s)
    bm.trim(s)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    assert len(bm.cached) == 1  # the one full block of real tokens, nothing of the drafts


def test_the_engine_metrics_expose_draft_and_accepted_tokens() -> None:
    from cachegw.backend.core.engine import EngineStats
    from cachegw.backend.entrypoints.metrics import ServerMetrics

    stats = EngineStats(
        0, 0, 0.0, 8, 0, 0, 0, 0, 12, spec_decode_draft_tokens=20, spec_decode_accepted_tokens=9
    )
    text = ServerMetrics(lambda: stats).render()[0].decode()
    assert "cachegw:spec_decode_draft_tokens_total 20.0" in text
    assert "cachegw:spec_decode_accepted_tokens_total 9.0" in text


def running(bm: BlockManager) -> tuple[Scheduler, Sequence]:
    """A sequence decoding its 8th token (7 computed, 2 blocks of 4) whose text repeats: it drafts."""
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, speculative_max_seqs=1)
    s = Sequence("r", [1, 2, 3, 1, 2, 3, 1], SamplingParams(max_tokens=9))
    bm.allocate(s, [], 7)
    s.num_computed_tokens = 7
    s.token_ids.append(2)
    s.spec = DraftSource(4, 1, 3)
    s.status = SequenceStatus.RUNNING
    sched.running.append(s)
    return sched, s


def test_a_decode_takes_its_drafts_when_blocks_allow() -> None:
    sched, s = running(BlockManager(4, 4))
    batch = sched.schedule()
    # "3 1 2" last ended at 5: what followed, then the same period on: 3 1 2 3
    assert batch.num_tokens == [5] and s.draft == [3, 1, 2, 3] and len(s.block_table) == 3


def test_drafts_are_dropped_before_anyone_is_preempted() -> None:
    sched, s = running(BlockManager(2, 4))  # no block free: the drafts' positions 8-11 do not fit
    batch = sched.schedule()
    assert batch.num_tokens == [1] and s.draft == [] and batch.num_preempted == 0


def test_a_larger_batch_decodes_without_drafts() -> None:
    bm = BlockManager(8, 4)
    sched, s = running(bm)
    other = Sequence("o", [7, 8, 9], SamplingParams(max_tokens=9))
    bm.allocate(other, [], 3)
    other.status = SequenceStatus.RUNNING
    sched.running.append(other)  # two running, speculative_max_seqs 1
    batch = sched.schedule()
    assert batch.num_tokens == [1, 3] and s.draft == []
