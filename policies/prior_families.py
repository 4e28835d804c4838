"""Which calibration family a scope's traffic resembles, judged by the scope's own audits (pure).

One prior cannot serve every kind of traffic: open-domain paraphrase questions (QQP) meet stored
neighbours that are about one in five wrong at any verifier score, while a support desk's intents
(banking77) meet neighbours wrong about one in fifty. Counted together they allow no line for either;
counted apart, each is right for its own kind and badly wrong for the other.

So the prior file keeps each family's counts apart, and a scope weighs them by how well each explains
the audits it has: with equal weights before any audit (the mixture, which is pessimistic enough to
allow no line on QQP-like rates), then by Bayes' rule, each family's likelihood computed from its
false-hit rate per score band (``BANDS`` bands of 0.1 from 0.50, Jeffreys-smoothed). The weights
concentrate quickly where the families differ: ten right audits make an intent-like family ~8 times
likelier than a QQP-like one, three wrong in ten the reverse by ~30 times.

The mixture is a prior, never a guarantee: ``bound_prior.contradicts`` drops it outright once the
scope's live audits at the line reject it, and ``PriorWeight`` fades it as live audits accumulate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from cachegw.policies.bound_prior import PriorCounts
from cachegw.policies.error_bound import GRID, Evidence

BANDS = 5  # 0.50-0.59, 0.60-0.69, 0.70-0.79, 0.80-0.89, 0.90-1.00


def band(cell: int) -> int:
    return min(BANDS - 1, cell // 10)


Counts = tuple[float, ...] | list[float]


def band_counts(audits: Counts, wrong: Counts) -> list[tuple[float, float]]:
    """(audits, wrong) per band."""
    out = [(0.0, 0.0)] * BANDS
    for i in range(len(GRID)):
        a, w = out[band(i)]
        out[band(i)] = (a + audits[i], w + wrong[i])
    return out


def band_rates(p: PriorCounts) -> list[float]:
    """Each band's false-hit rate under a family, (wrong + 1/2) / (audits + 1): never 0 or 1."""
    return [(w + 0.5) / (a + 1.0) for a, w in band_counts(p.audits, p.wrong)]


def weights(live: Evidence, families: Mapping[str, PriorCounts]) -> dict[str, float]:
    """Each family's posterior weight given the scope's live audits (equal before any)."""
    if not families:
        return {}
    live_bands = band_counts(live.audits, live.wrong)
    logs = {}
    for name, p in families.items():
        rates = band_rates(p)
        logs[name] = sum(
            w * math.log(r) + (a - w) * math.log(1.0 - r)
            for (a, w), r in zip(live_bands, rates, strict=True)
            if a > 0
        )
    top = max(logs.values())
    raw = {k: math.exp(v - top) for k, v in logs.items()}
    total = sum(raw.values())
    return {k: v / total for k, v in raw.items()}


@dataclass(frozen=True)
class Resembled:
    """The prior a scope gets: the families' counts mixed by ``weights`` (each family scaled to the
    largest family's total first, so a family counts by its weight, not by its size)."""

    counts: PriorCounts
    weights: dict[str, float]


def resembled(live: Evidence, families: Mapping[str, PriorCounts]) -> Resembled | None:
    """The mixture the scope's live audits point to (None: no family)."""
    ws = weights(live, families)
    if not ws:
        return None
    size = max(p.total for p in families.values())
    audits = [0.0] * len(GRID)
    wrong = [0.0] * len(GRID)
    for name, p in families.items():
        if p.total <= 0:
            continue
        k = ws[name] * size / p.total
        for i in range(len(GRID)):
            audits[i] += k * p.audits[i]
            wrong[i] += k * p.wrong[i]
    return Resembled(PriorCounts(tuple(audits), tuple(wrong)), ws)
