"""The semantic line from a false-hit bound: the lowest score at which hits are wrong at most
``target`` of the time, with stated confidence (pure code; ``gateway/cache/error_control.py`` feeds it).

Evidence is audited pairs (score, right or wrong), where the score is what the serving decision
thresholds on (the verifier's final probability, or the cosine when the verifier is off). For a
candidate line t the hits it would serve are the pairs scoring >= t; their false-hit rate has an exact
one-sided Clopper-Pearson upper bound, and t qualifies when that bound is at most the target.

Many candidate lines are tested on the same evidence, which would inflate the error (the
multiple-testing trap) if the best-looking one were simply picked. The lines are tested as a fixed
sequence instead: from the strictest down, stopping at the first that fails. A fixed sequence keeps
the family-wise error at 1 - confidence without any correction (a line is only reached when every
stricter one passed), where a union bound over the grid would test each at 1 - (1-confidence)/50 and
need several times the audits. The sequence starts at the strictest line holding enough audits to
pass with no wrong one at all (``min_audits``): that start depends on how many audits there are, never
on their verdicts, so the guarantee holds given the audited scores.

Counts may be fractional (a prior's pseudo-audits, ``policies/bound_prior.py``): the bound is then the
same Beta quantile at real parameters, the continuous extension of the integer Clopper-Pearson bound,
monotone in both counts (more wrong raises it, more audits at the same wrong share lower it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scipy.stats import beta

# Candidate lines, fixed in advance: 0.50, 0.51, ..., 0.99, 1.00 (a score is a probability or a cosine).
GRID: tuple[float, ...] = tuple(round(0.5 + 0.01 * i, 2) for i in range(51))
CONFIDENCE = 0.95


def _counts(wrong: float, n: float) -> float:
    """``wrong``, checked against ``n`` (a float sum may pass ``n`` by rounding: clipped)."""
    if 0 <= n < wrong <= n + 1e-9 * max(1.0, n):
        return n
    if not 0 <= wrong <= n:
        raise ValueError(f"need 0 <= wrong <= n, got wrong={wrong}, n={n}")
    return wrong


def upper_bound(wrong: float, n: float, confidence: float = CONFIDENCE) -> float:
    """One-sided Clopper-Pearson upper bound of a rate seen ``wrong`` times in ``n``: the rate p with
    P(Binomial(n, p) <= wrong) = 1 - confidence (1.0 with no evidence or all wrong)."""
    wrong = _counts(wrong, n)
    if wrong == n:
        return 1.0
    return float(beta.ppf(confidence, wrong + 1, n - wrong))


def interval(wrong: float, n: float, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Two-sided Clopper-Pearson interval at ``confidence`` (what the stats show)."""
    wrong = _counts(wrong, n)
    tail = (1 - confidence) / 2
    lo = 0.0 if wrong == 0 else float(beta.ppf(tail, wrong, n - wrong + 1))
    hi = 1.0 if wrong == n else float(beta.ppf(1 - tail, wrong + 1, n - wrong))
    return lo, hi


def min_audits(target: float, confidence: float = CONFIDENCE) -> int:
    """The fewest audits, all right, whose upper bound is at most ``target``: (1-target)^n <= 1-conf."""
    if not 0 < target < 1:
        raise ValueError(f"target must be in (0, 1), got {target}")
    return math.ceil(math.log(1 - confidence) / math.log(1 - target))


def bucket(score: float) -> int:
    """The grid cell of a score: the highest line it reaches, -1 under the lowest."""
    if score < GRID[0]:
        return -1
    return min(len(GRID) - 1, int(math.floor((score - GRID[0]) * 100 + 1e-9)))


@dataclass
class Evidence:
    """Audit counts of one scope, per grid cell: cell i holds pairs with GRID[i] <= score < GRID[i+1]."""

    audits: list[float] = field(default_factory=lambda: [0] * len(GRID))
    wrong: list[float] = field(default_factory=lambda: [0] * len(GRID))

    def add(self, score: float, right: bool, count: int = 1) -> None:
        i = bucket(score)
        if i >= 0:
            self.audits[i] += count
            self.wrong[i] += 0 if right else count

    def merge(self, other: Evidence) -> None:
        for i in range(len(GRID)):
            self.audits[i] += other.audits[i]
            self.wrong[i] += other.wrong[i]

    def at(self, line: float) -> tuple[float, float]:
        """(wrong, audits) among pairs scoring >= ``line``."""
        i = max(0, bucket(line))
        return sum(self.wrong[i:]), sum(self.audits[i:])

    @property
    def total(self) -> float:
        return sum(self.audits)


@dataclass(frozen=True)
class Choice:
    """The line the bound allows (None: none qualifies, serve no semantic hit) and its evidence."""

    line: float | None
    wrong: float  # fractional where a prior's pseudo-audits count
    audits: float
    bound: float  # upper bound at the line (or at the last line tried when none qualified)


def choose_line(ev: Evidence, target: float, confidence: float = CONFIDENCE, start: float = 0.0) -> Choice:
    """The lowest grid line whose hits' false-hit bound is <= ``target``, by fixed-sequence testing
    from the strictest line that holds ``min_audits`` audits (or ``start``, when more), downwards,
    stopping at the first failure. Only lines at an audited score are tested: one in an empty cell
    would serve scores no audit saw. A later ``start`` suits large evidence (a prior's): a line tested
    on ``min_audits`` alone passes only with no wrong one, and a single wrong hit up there would stop
    the scan; the start still depends on counts only, so the guarantee stands."""
    need = max(float(min_audits(target, confidence)), start)
    chosen: Choice | None = None
    last = Choice(None, 0, 0, 1.0)
    started = False
    for i in reversed(range(len(GRID))):
        if ev.audits[i] == 0:
            continue  # a line inside an empty cell serves scores nothing vouches for; same test as above
        t = GRID[i]
        wrong, n = ev.at(t)
        if not started and n < need:
            continue  # too few audits to pass even with no wrong one: not a test yet
        started = True
        ub = upper_bound(wrong, n, confidence)
        if ub > target:
            last = Choice(None, wrong, n, ub)
            break
        chosen = Choice(t, wrong, n, ub)
    return chosen or last
