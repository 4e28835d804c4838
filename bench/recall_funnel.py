"""Where recall goes: each calibration pair's path through the semantic tier at one rule, counted per
stage, for the positives (a right answer lost there) and the negatives (a wrong answer stopped there,
or served).

    .venv/bin/python -m bench.recall_funnel

Stages, in the tier's order: the index's nearest candidate is not the pair's partner (``retrieval``,
measured apart: QQP's positives whose partner is not the nearest of all calibration questions;
banking77's texts whose nearest neighbour has another intent, which the pair set counts as negatives);
then, for the pair itself, ``alignment`` (a document or code differs), ``cosine`` (under the floor),
``guard``, ``mlp`` (under ``min_prob ** 2``: the cross-encoder is never asked; for a focus inside a
longer message, under ``min_prob``), ``cross`` (the geometric mean under ``min_prob``; ``cross_vetoed``
counts those the MLP alone would have served), else ``served``. Calibration sets only: the held-out
halves are never looked at here. Writes bench/results/recall_funnel.json.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.hit_choice import Pairs, Scored
from cachegw.policies.verifier import DEFAULT_RULE, DecisionRule

STAGES = ("alignment", "cosine", "guard", "mlp", "cross", "served")


def stages(s: Scored, rule: DecisionRule = DEFAULT_RULE, sure: float = 0.98) -> np.ndarray:
    """Each pair's stage name (the first that stops it, or ``served``) under ``rule``."""
    n = len(s.cos)
    out = np.full(n, "served", dtype=object)
    comb = np.sqrt(s.p_mlp * np.nan_to_num(s.p_cross, nan=1.0))
    for i in range(n):
        if s.fixed[i]:
            out[i] = "served" if s.fixed_accept[i] else "alignment"
        elif s.cos[i] < rule.min_cosine:
            out[i] = "cosine"
        elif s.guarded[i]:
            out[i] = "guard"
        elif s.partial[i]:
            out[i] = "served" if s.p_mlp[i] >= rule.min_prob else "mlp"
        elif s.p_mlp[i] < rule.min_prob**2:
            out[i] = "mlp"
        elif s.p_mlp[i] >= sure:
            out[i] = "served"
        elif comb[i] < rule.min_prob:
            out[i] = "cross"
    return out


def funnel(ps: Pairs, s: Scored, rule: DecisionRule = DEFAULT_RULE, sure: float = 0.98) -> dict[str, Any]:
    """Counts per stage for positives and negatives, and the cross-encoder's vetoes of pairs the MLP
    alone would have served (p_mlp >= min_prob)."""
    st = stages(s, rule, sure)
    vetoed = (st == "cross") & (s.p_mlp >= rule.min_prob)
    return {
        label: {
            "pairs": int(mask.sum()),
            **{k: int(((st == k) & mask).sum()) for k in STAGES},
            "cross_vetoed_mlp_accept": int((vetoed & mask).sum()),
        }
        for label, mask in (("positives", ps.y), ("negatives", ~ps.y))
    }


def qqp_retrieval(ps: Pairs, vecs: dict[str, np.ndarray]) -> dict[str, int]:
    """QQP positives whose partner is not question 1's nearest among all the set's questions (other
    than itself): a cache holding them all would offer question 1 another candidate first."""
    texts = sorted(set(ps.q1) | set(ps.q2))
    row = {t: i for i, t in enumerate(texts)}
    emb = np.stack([vecs[t] for t in texts])
    lost = 0
    pos = np.flatnonzero(ps.y)
    for start in range(0, len(pos), 512):
        idx = pos[start : start + 512]
        q = np.array([row[ps.q1[i]] for i in idx])
        sims = emb[q] @ emb.T
        sims[np.arange(len(q)), q] = -2.0
        nearest = sims.argmax(axis=1)
        lost += int(sum(nearest[k] != row[ps.q2[i]] for k, i in enumerate(idx)))
    return {"positives": len(pos), "partner_not_nearest": lost}


def banking_retrieval(ps: Pairs) -> dict[str, int]:
    """banking77 texts (each of an intent with many texts) whose nearest neighbour has another intent."""
    return {"texts": len(ps.y), "nearest_other_intent": int((~ps.y).sum())}
