"""The rule search of bench/recall_rule.py: today's rule expressed as a ``Rule`` gives the verdicts
``bench/hit_choice.py`` (and the gateway) give, and the search never picks a rule that serves a
calibration set more wrong answers or a lower precision than today's."""

from __future__ import annotations

import numpy as np

from bench.hit_choice import Pairs, Scored, accepted
from bench.recall_rule import Rule, counts, derive_sure, search


def synthetic(n: int, seed: int) -> tuple[Pairs, Scored]:
    rng = np.random.default_rng(seed)
    y = rng.random(n) < 0.4
    cos = np.clip(0.75 + 0.2 * rng.random(n) + 0.05 * y, 0, 1)
    p_mlp = np.clip(rng.beta(2, 2, n) + 0.3 * y, 0, 1)
    p_cross = np.clip(rng.beta(2, 2, n) + 0.3 * y, 0, 1)
    fixed = rng.random(n) < 0.05
    s = Scored(
        fixed, fixed & (rng.random(n) < 0.5), rng.random(n) < 0.05, cos, rng.random(n) < 0.05, p_mlp, p_cross
    )
    return Pairs([f"a{i}" for i in range(n)], [f"b{i}" for i in range(n)], y), s


def test_todays_rule_as_a_rule_gives_the_same_verdicts() -> None:
    for seed in range(3):
        _, s = synthetic(2000, seed)
        today = Rule(0.88, 0.80, 0.5, 0.98)
        assert (today.accepted(s) == accepted(s, "skip", 0.98)).all()
        assert (Rule(0.88, 0.80, 0.0).accepted(s) == accepted(s, "mlp")).all()


def test_search_keeps_every_sets_precision_and_wrong_answers() -> None:
    sets = {"qqp": synthetic(3000, 1), "banking77": synthetic(3000, 2), "units": synthetic(200, 3)}
    base = {k: Rule(0.88, 0.80, 0.5).accepted(s) for k, (_, s) in sets.items()}
    best, table = search(sets, base)
    assert best is not None and table
    for k, (ps, s) in sets.items():
        tp, fp = counts(ps, best.accepted(s))
        tp0, fp0 = counts(ps, base[k])
        if k == "units":
            assert fp <= fp0
        else:
            assert tp / (tp + fp) >= tp0 / (tp0 + fp0)
    assert any(all(r[k] == v for k, v in best.__dict__.items()) for r in table)  # the winner is listed
    assert derive_sure(sets, Rule(best.min_cosine, best.min_prob, 0.0)) == 2.0  # no cross-encoder to skip
