"""A prior for the false-hit bound: labelled pairs scored offline, counted as pseudo-audits of bounded
weight until a scope's own audits take over (pure; ``gateway/cache/prior_loader.py`` loads the file).

Without it a new deployment has no evidence and the bound serves no semantic hit until hundreds of
audits arrive. With it, a scope's evidence is its live audits plus the prior's per-cell counts scaled
by ``weight``: at most ``strength`` pseudo-audits in all, falling linearly to none once the scope has
``fade`` live audits. The line is then chosen from the sum exactly as from live evidence
(``choose_line``); the counts may be fractional, which the Clopper-Pearson bound takes as the
continuous extension of its integer form (``policies/error_bound.py``).

What the line then guarantees is conditional: the bound holds for the scope's hits only as far as its
traffic resembles the calibration pairs, until its own audits outweigh them; after ``fade`` audits the
prior no longer counts and the guarantee is the live one again. Before that, ``contradicts`` drops the
prior as soon as the scope's live audits at the line reject the prior's false-hit rate there (a
one-sided binomial test at the bound's confidence), or, from ``CHECK_AFTER`` of them on, are wrong more
often than the target: traffic worse than the calibration loses the prior's line within a handful of
wrong audits, not after ``fade``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import binom

from cachegw.policies.error_bound import CONFIDENCE, GRID, Evidence, bucket

# With a prior the fixed sequence starts where this many times ``min_audits`` pairs are at or above the
# line: tested on the fewest, a line passes only with none wrong, and calibration data holds a few
# wrong pairs even at the top. A count, never a verdict, so the family-wise guarantee is unchanged.
START_FACTOR = 3
# Live audits at the line after which their own wrong share, over the target, drops the prior: early
# traffic can look cleaner than later traffic (a small store meets fewer wrong neighbours), and the
# prior's pseudo-audits would otherwise outvote what the scope's hits are showing.
CHECK_AFTER = 20


@dataclass(frozen=True)
class PriorCounts:
    """Per grid cell: candidates among the calibration pairs, and how many of them were wrong."""

    audits: tuple[float, ...]
    wrong: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.audits) != len(GRID) or len(self.wrong) != len(GRID):
            raise ValueError(f"a prior needs {len(GRID)} cells of audits and of wrong")
        if any(not 0 <= w <= a for a, w in zip(self.audits, self.wrong, strict=True)):
            raise ValueError("each cell needs 0 <= wrong <= audits")

    @property
    def total(self) -> float:
        return float(sum(self.audits))

    @classmethod
    def from_scores(cls, scores: np.ndarray, right: np.ndarray) -> PriorCounts:
        """Counts from candidate scores (NaN: not a candidate) and whether each pair was a right hit."""
        audits, wrong = [0] * len(GRID), [0] * len(GRID)
        for s, r in zip(scores, right, strict=True):
            i = -1 if np.isnan(s) else bucket(float(s))
            if i >= 0:
                audits[i] += 1
                wrong[i] += 0 if r else 1
        return cls(tuple(map(float, audits)), tuple(map(float, wrong)))


@dataclass(frozen=True)
class PriorWeight:
    """``[cache.error_bound] false_hit_prior_strength`` and ``false_hit_prior_fade``."""

    strength: float  # pseudo-audits at most (0: the prior is off)
    fade: int  # live audits of a scope after which the prior no longer counts

    def scale(self, prior_total: float, live: float) -> float:
        """The factor on the prior's counts: at most ``strength`` pseudo-audits, times 1 - live/fade."""
        if prior_total <= 0 or self.strength <= 0 or self.fade <= 0 or live >= self.fade:
            return 0.0
        return min(1.0, self.strength / prior_total) * (1.0 - live / self.fade)


def with_prior(live: Evidence, prior: PriorCounts | None, weight: PriorWeight) -> tuple[Evidence, float]:
    """The scope's evidence: live counts plus the prior's scaled by ``weight`` (a new Evidence; the
    live one is left alone), and the pseudo-audits the prior added (0: live alone)."""
    k = weight.scale(prior.total, live.total) if prior is not None else 0.0
    if prior is None or k == 0.0:
        return live, 0.0
    merged = Evidence(
        [a + k * p for a, p in zip(live.audits, prior.audits, strict=True)],
        [w + k * p for w, p in zip(live.wrong, prior.wrong, strict=True)],
    )
    return merged, k * prior.total


def contradicts(
    live: Evidence, prior: PriorCounts, line: float, target: float, confidence: float = CONFIDENCE
) -> bool:
    """Whether the scope's live audits at or above ``line`` overrule the prior there: at least
    ``CHECK_AFTER`` of them wrong more often than ``target``, or (with any number) that many wrong or
    more would come with probability under 1 - ``confidence`` at the prior's rate."""
    wrong, n = live.at(line)
    p_wrong, p_n = Evidence(list(prior.audits), list(prior.wrong)).at(line)
    if wrong <= 0 or p_n <= 0:
        return False
    if n >= CHECK_AFTER and wrong / n > target:
        return True
    k, trials = round(wrong), round(n)
    rate = (p_wrong + 0.5) / (p_n + 1.0)  # never 0: a prior of no wrong pairs claims a small rate, not none
    return float(binom.sf(k - 1, trials, rate)) < 1 - confidence
