"""The hit rule for a verifier, chosen on calibration sets only: the cosine floor, ``min_prob`` and the
weight of the cross-encoder in the final probability, ``p_mlp ** (1 - w) * p_cross ** w`` (w = 0.5 is
today's geometric mean; w = 0: the MLP alone).

A rule qualifies when, on every calibration set, it serves no more wrong answers than today's rule on
the same set (the families) and its precision is no lower (QQP, banking77); of those, the one whose
smaller recall gain over today's on QQP and banking77 is largest wins, then the most right answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.hit_choice import Pairs, Scored

FLOORS = np.round(np.arange(0.78, 0.9001, 0.01), 2)
PROBS = np.round(np.arange(0.50, 0.9501, 0.01), 2)
WEIGHTS = (0.0, 0.5)  # the MLP alone (cross_verifier = false) or today's geometric mean: no new setting
RATIO_SETS = ("qqp", "banking77")


@dataclass(frozen=True)
class Rule:
    min_cosine: float
    min_prob: float
    cross_weight: float
    sure: float = 2.0  # the cross-encoder not asked (its weight taken as 1) where p_mlp >= sure

    def final(self, s: Scored) -> np.ndarray:
        """The final probability of each pair (focus pairs inside long messages: the MLP's alone)."""
        w = self.cross_weight
        # not asked (a skipped pair, or one scored without it): the most it could reach, p_cross = 1
        p_cross = np.where(np.isnan(s.p_cross) | (s.p_mlp >= self.sure), 1.0, s.p_cross)
        whole = s.p_mlp ** (1.0 - w) * p_cross**w
        return np.where(s.partial, s.p_mlp, whole)

    def accepted(self, s: Scored) -> np.ndarray:
        judged = ~s.fixed & (s.cos >= self.min_cosine) & ~s.guarded
        return (s.fixed & s.fixed_accept) | (judged & (self.final(s) >= self.min_prob))


def counts(ps: Pairs, acc: np.ndarray) -> tuple[int, int]:
    return int((acc & ps.y).sum()), int((acc & ~ps.y).sum())


def gain(ps: Pairs, acc: np.ndarray, acc0: np.ndarray) -> float:
    """Right answers served against today's on the same set."""
    return counts(ps, acc)[0] / max(counts(ps, acc0)[0], 1)


def qualifies(sets: dict[str, tuple[Pairs, Scored]], base: dict[str, np.ndarray], rule: Rule) -> bool:
    for k, (ps, s) in sets.items():
        tp, fp = counts(ps, rule.accepted(s))
        tp0, fp0 = counts(ps, base[k])
        if k in RATIO_SETS:
            if tp * (tp0 + fp0) < tp0 * (tp + fp):  # precision below today's
                return False
        elif fp > fp0:
            return False
    return True


def search(
    sets: dict[str, tuple[Pairs, Scored]],
    base: dict[str, np.ndarray],
    sure: float = 2.0,
    floors: np.ndarray = FLOORS,
    weights: tuple[float, ...] = WEIGHTS,
) -> tuple[Rule | None, list[dict[str, Any]]]:
    """The best qualifying rule on the grid, and every qualifying rule's recall gains (for the JSON)."""
    best: tuple[float, int, Rule] | None = None
    table = []
    for w in weights:
        for floor in floors:
            for p in PROBS:
                rule = Rule(float(floor), float(p), w, sure)
                if not qualifies(sets, base, rule):
                    continue
                gains = {k: gain(sets[k][0], rule.accepted(sets[k][1]), base[k]) for k in RATIO_SETS}
                right = sum(counts(ps, rule.accepted(s))[0] for ps, s in sets.values())
                table.append({**rule.__dict__, **{f"gain_{k}": round(g, 3) for k, g in gains.items()}})
                key = (min(gains.values()), right, rule)
                if best is None or key[:2] > best[:2]:
                    best = key
    return (None if best is None else best[2]), table


def derive_sure(sets: dict[str, tuple[Pairs, Scored]], rule: Rule) -> float:
    """The lowest ``sure`` (grid 0.64-1.00, step 0.005) at which leaving the cross-encoder out changes no
    verdict on any calibration set; 2.0 (always ask) when even 1.0 changes one, or with no cross-encoder."""
    if rule.cross_weight <= 0:
        return 2.0
    full = {
        k: Rule(rule.min_cosine, rule.min_prob, rule.cross_weight).accepted(s) for k, (_, s) in sets.items()
    }
    best = 2.0
    for t in np.round(np.arange(1.0, 0.6399, -0.005), 3):
        skip = Rule(rule.min_cosine, rule.min_prob, rule.cross_weight, float(t))
        if any((skip.accepted(s) ^ full[k]).any() for k, (_, s) in sets.items()):
            break
        best = float(t)
    return best
