"""The evaluation harness shared by the verifier experiments (token alignment, adapters).

The same QQP split, the same operating-point choice on the validation slice, the same ORACLE figure
(best test precision at recall >= TARGET_RECALL, a ceiling and not a claim), so the experiments'
tables compare like with like.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cachegw.policies.pair_guards import guard_reason
from cachegw.policies.verifier import DEFAULT_RULE

TARGET_RECALL = 0.30
PROB_GRID = np.round(np.arange(0.30, 0.995, 0.005), 3)


@dataclass
class PairSet:
    q1: list[str]
    q2: list[str]
    y: np.ndarray  # bool
    vetoed: np.ndarray  # bool: a hard guard fires (never reaches the MLP, prob 0)


def pair_set(rows: list[dict[str, str]]) -> PairSet:
    q1, q2 = [r["question1"] for r in rows], [r["question2"] for r in rows]
    y = np.array([r["is_duplicate"] == "1" for r in rows])
    vetoed = np.array([guard_reason(a, b) is not None for a, b in zip(q1, q2, strict=True)])
    return PairSet(q1, q2, y, vetoed)


def qqp_pair_sets() -> tuple[PairSet, PairSet, dict[str, Any]]:
    """The train and test PairSets of ``split_qqp`` on qqp_dev.csv, with the split's description."""
    from bench.verifier_quality import _read_csv, split_qqp

    train_rows, test_rows, info = split_qqp(_read_csv("qqp_dev.csv"))
    return pair_set(train_rows), pair_set(test_rows), info


def subset(ps: PairSet, mask: np.ndarray) -> PairSet:
    idx = np.flatnonzero(mask)
    return PairSet([ps.q1[i] for i in idx], [ps.q2[i] for i in idx], ps.y[mask], ps.vetoed[mask])


def prf(y: np.ndarray, acc: np.ndarray) -> dict[str, float]:
    tp = float((acc & y).sum())
    p, r = tp / max(float(acc.sum()), 1.0), tp / max(float(y.sum()), 1.0)
    return {"precision": round(p, 4), "recall": round(r, 4), "accepted": int(acc.sum())}


def choose_prob(y: np.ndarray, cos: np.ndarray, prob: np.ndarray) -> float:
    """Highest-precision ``min_prob`` (at the shipped cosine floor) with recall >= TARGET_RECALL."""
    gate = cos >= DEFAULT_RULE.min_cosine
    best = (-1.0, float(PROB_GRID[0]))
    for t in PROB_GRID:
        m = prf(y, gate & (prob >= t))
        if m["recall"] >= TARGET_RECALL and m["precision"] > best[0]:
            best = (m["precision"], float(t))
    return best[1]


def oracle(y: np.ndarray, cos: np.ndarray, prob: np.ndarray) -> dict[str, float]:
    """Best precision over every ``min_prob`` cut at the cosine floor with recall >= TARGET_RECALL."""
    s = np.where(cos >= DEFAULT_RULE.min_cosine, prob, -1.0)
    order = np.argsort(-s, kind="stable")
    tp = np.cumsum(y[order])
    k = np.arange(1, len(y) + 1)
    ok = (tp / max(y.sum(), 1) >= TARGET_RECALL) & (s[order] > 0)
    if not ok.any():
        return {"precision": 0.0, "recall": 0.0, "min_prob": 1.0}
    i = int(np.argmax(np.where(ok, tp / k, -1.0)))
    return {
        "precision": round(float(tp[i] / k[i]), 4),
        "recall": round(float(tp[i] / y.sum()), 4),
        "min_prob": round(float(s[order][i]), 4),
    }


def precision_at_recalls(
    y: np.ndarray, cos: np.ndarray, prob: np.ndarray, recalls: tuple[float, ...] = (0.1, 0.2, 0.25, 0.3)
) -> dict[str, float]:
    """Test precision of the shortest ranking prefix (cosine floor, then prob) reaching each recall."""
    s = np.where(cos >= DEFAULT_RULE.min_cosine, prob, -1.0)
    order = np.argsort(-s, kind="stable")
    tp = np.cumsum(y[order])
    out = {}
    for r in recalls:
        i = int(np.searchsorted(tp, r * y.sum()))
        out[f"R{r:.2f}"] = round(float(tp[i] / (i + 1)), 4) if i < len(y) and s[order][i] > 0 else 0.0
    return out


def auc(y: np.ndarray, s: np.ndarray) -> float:
    from scipy.stats import rankdata

    ranks = rankdata(s)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / max(n_pos * n_neg, 1))


def operating_points(
    va: PairSet, vcos: np.ndarray, vprob: np.ndarray, te: PairSet, tcos: np.ndarray, tprob: np.ndarray
) -> dict[str, Any]:
    """One seed's figures: min_prob chosen on validation, test at it, at the default rule, ORACLE."""
    t = choose_prob(va.y, vcos, vprob)
    floor = DEFAULT_RULE.min_cosine
    passed = ~te.vetoed
    return {
        "val_chosen_min_prob": t,
        "val_at_chosen": prf(va.y, (vcos >= floor) & (vprob >= t)),
        "test_at_val_chosen": prf(te.y, (tcos >= floor) & (tprob >= t)),
        "test_default_rule": prf(te.y, (tcos >= floor) & (tprob >= DEFAULT_RULE.min_prob)),
        "test_oracle_recall_ge_0.3": oracle(te.y, tcos, tprob),
        "val_oracle_recall_ge_0.3": oracle(va.y, vcos, vprob),
        "test_precision_at_recall": precision_at_recalls(te.y, tcos, tprob),
        "test_auc_unvetoed": round(auc(te.y[passed], tprob[passed]), 4),
    }
