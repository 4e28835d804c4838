"""The sampler on hand-made logits: greedy, top-k/top-p masks, seeded draws, log-probabilities."""

from __future__ import annotations

import pytest
import torch

from cachegw.backend.core.sampling_params import InvalidParameter, SamplingParams
from cachegw.backend.core.sequence import Sequence
from cachegw.backend.executor.sampler import _filter_top_k_top_p, apply_penalties, sample

VOCAB = 8


def seq(rid: str, **params) -> Sequence:
    s = Sequence(rid, [1, 2, 3], SamplingParams(**params))
    if s.params.seed is not None:
        s.generator = torch.Generator().manual_seed(s.params.seed)
    return s


def logits_rows(*peaks: int) -> torch.Tensor:
    """One row per peak: a clear favourite, then decreasing logits."""
    rows = torch.stack([-torch.arange(VOCAB, dtype=torch.float32) for _ in peaks])
    for r, p in enumerate(peaks):
        rows[r, p] = 5.0
    return rows


def test_greedy_rows_take_the_argmax() -> None:
    out = sample(logits_rows(3, 6), [seq("a", temperature=0.0), seq("b", temperature=0.0)], torch.Generator())
    assert out.token_ids == [3, 6]
    assert out.logprobs == [None, None]


def test_top_k_one_is_greedy_whatever_the_temperature() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        out = sample(logits_rows(4), [seq("a", temperature=2.0, top_k=1)], gen)
        assert out.token_ids == [4]


def test_filter_keeps_top_k_and_nucleus_and_always_the_top_token() -> None:
    logits = torch.log(
        torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02]])
    )
    out = _filter_top_k_top_p(logits, torch.tensor([2, -1, -1]), torch.tensor([1.0, 0.7, 1e-30]))
    kept = torch.isfinite(out).tolist()
    assert kept[0] == [True, True, False, False]  # top-k 2
    assert kept[1] == [True, True, False, False]  # mass before the 3rd token is 0.8 >= 0.7
    assert kept[2] == [True, False, False, False]  # a tiny top_p still keeps the top token
    assert torch.equal(out[0, :2], logits[0, :2])


def test_seeded_draws_do_not_depend_on_batch_neighbours() -> None:
    flat = torch.zeros(3, VOCAB)
    alone = sample(flat[:1], [seq("a", seed=7)], torch.Generator()).token_ids[0]
    s_a, s_b, s_c = seq("a", seed=7), seq("b", seed=99), seq("c")
    together = sample(flat, [s_b, s_a, s_c], torch.Generator().manual_seed(1)).token_ids
    assert together[1] == alone
    draws = [sample(flat[:1], [seq("a", seed=7)], torch.Generator()).token_ids[0] for _ in range(5)]
    assert len(set(draws)) == 1


def test_logprobs_are_the_models_before_temperature_with_top_alternatives() -> None:
    logits = logits_rows(2)
    out = sample(logits, [seq("a", temperature=0.0, logprobs=3)], torch.Generator())
    expected = logits[0].log_softmax(-1)
    entry = out.logprobs[0]
    assert entry is not None and entry["token_id"] == 2
    assert abs(entry["logprob"] - float(expected[2])) < 1e-6
    assert [t for t, _ in entry["top"]] == expected.topk(3).indices.tolist()
    only_chosen = sample(logits, [seq("a", temperature=0.0, logprobs=0)], torch.Generator()).logprobs[0]
    assert only_chosen is not None and only_chosen["top"] == []


def test_penalties_follow_openais_formula_on_generated_tokens_only() -> None:
    """logit[j] - count[j] * frequency - (count[j] > 0) * presence; prompt tokens do not count."""
    s = seq("a", temperature=0.0, frequency_penalty=0.5, presence_penalty=1.0)
    s.token_ids += [2, 2, 5]  # generated: token 2 twice, token 5 once (prompt is 1, 2, 3)
    logits = torch.zeros(1, VOCAB)
    apply_penalties(logits, [s])
    expected = torch.zeros(VOCAB)
    expected[2] = -(2 * 0.5 + 1.0)
    expected[5] = -(1 * 0.5 + 1.0)
    assert torch.equal(logits[0], expected)


def test_logit_bias_moves_the_argmax_and_spares_other_rows() -> None:
    rows = logits_rows(3, 3)
    plain = rows[1].clone()
    seqs = [seq("a", temperature=0.0, logit_bias={"6": 100}), seq("b", temperature=0.0)]
    out = sample(rows, seqs, torch.Generator())
    assert out.token_ids == [6, 3]
    assert torch.equal(rows[1], plain)  # a row without penalties is untouched


def test_logprobs_are_the_models_own_despite_the_bias() -> None:
    rows = logits_rows(3)
    expected = rows[0].log_softmax(-1)[6].item()
    out = sample(rows, [seq("a", temperature=0.0, logprobs=0, logit_bias={"6": 100})], torch.Generator())
    assert out.token_ids == [6] and out.logprobs[0]["logprob"] == pytest.approx(expected)


@pytest.mark.parametrize("bias", [{"x": 1}, {"-3": 1}, {"1": 100.5}, {"1": "up"}, {"1": True}, [1]])
def test_bad_logit_bias_names_the_param(bias) -> None:
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(logit_bias=bias)
    assert err.value.param == "logit_bias"
