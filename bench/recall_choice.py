"""Today's verifier against a candidate (other MLP and cross-encoder artifacts, another rule), for
``bench/hit_choice.py``'s candidate column: the funnel of today's rule on the calibration sets, the
candidate's rule chosen on calibration sets only (``bench/recall_rule.py``), and both on the held-out
halves.

Calibration sets: ``recall_pairs.calibration_sets`` (the families' tune split, QQP's calibration
half, and banking77's *tune* part, since its *fit* part trained the candidate). The funnel reads
``hit_choice.pair_sets``' calibration sets, as the earlier sections did.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import ROOT, say
from bench.hit_choice import Pairs, Scored, prf, score
from bench.recall_funnel import banking_retrieval, funnel, qqp_retrieval
from bench.recall_rule import Rule, derive_sure, search
from cachegw.embeddings.cross_onnx import CrossScorer
from cachegw.policies.verifier import DEFAULT_RULE, DecisionRule, Verifier

SCORED = DecisionRule(min_cosine=0.78, min_prob=0.0)  # scores kept for every rule the search tries
MLP_FILE = "policies/artifacts/verifier.npz"
CROSS_FILE = "embeddings/artifacts/cross_encoder.npz"


def artifacts_at(rev: str) -> tuple[Path, Path]:
    """The MLP and cross-encoder artifacts as of git revision ``rev`` (today's, once a new one ships)."""
    out = Path(tempfile.mkdtemp(prefix=f"cachegw-artifacts-{rev[:12]}-"))
    paths = []
    for name in (MLP_FILE, CROSS_FILE):
        dest = out / Path(name).name
        dest.write_bytes(subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, capture_output=True,
                                        check=True).stdout)  # fmt: skip
        paths.append(dest)
    return paths[0], paths[1]


def verifier(mlp: Path, cross: Path) -> Verifier:
    """The pair as the gateway serves it (the cross-encoder in int8 ONNX)."""
    return Verifier.load(mlp, CrossScorer(cross).load())


def today_rule() -> Rule:
    return Rule(DEFAULT_RULE.min_cosine, DEFAULT_RULE.min_prob, 0.5, 0.98)


def scored_sets(
    v: Verifier, sets: dict[str, Pairs], vecs: dict[str, np.ndarray]
) -> dict[str, tuple[Pairs, Scored]]:
    cache: dict[tuple[str, str], float] = {}  # one per verifier: keyed by the texts only
    return {k: (ps, score(v, ps, vecs, cache, SCORED)) for k, ps in sets.items()}


def report(sets: dict[str, tuple[Pairs, Scored]], rule: Rule) -> dict[str, Any]:
    """Precision / recall / wrong answers per set, and the cross-encoder calls per served answer."""
    out = {}
    for k, (ps, s) in sets.items():
        acc = rule.accepted(s)
        asked = ~s.fixed & ~s.partial & ~s.guarded & (s.cos >= rule.min_cosine) & ~np.isnan(s.p_cross)
        reach = s.p_mlp ** (1 - rule.cross_weight) >= rule.min_prob
        calls = int((asked & reach & (s.p_mlp < rule.sure)).sum()) if rule.cross_weight > 0 else 0
        out[k] = {
            **prf(ps.y, acc),
            "cross_calls": calls,
            "cross_calls_per_hit": round(calls / max(int(acc.sum()), 1), 3),
        }
    return out


def evaluate(
    before: Verifier,
    cand: Verifier,
    funnel_sets: dict[str, Pairs],
    calib: dict[str, Pairs],
    held: dict[str, Pairs],
    vecs: dict[str, np.ndarray],
) -> dict[str, Any]:
    say("candidate: scoring calibration and held-out sets with both verifiers")
    f_sets = scored_sets(before, funnel_sets, vecs)
    res: dict[str, Any] = {
        "funnel_today_calibration": {k: funnel(ps, s) for k, (ps, s) in f_sets.items()},
        "retrieval_calibration": {
            "qqp": qqp_retrieval(funnel_sets["qqp"], vecs),
            "banking77": banking_retrieval(funnel_sets["banking77"]),
        },
    }
    b_cal, c_cal = scored_sets(before, calib, vecs), scored_sets(cand, calib, vecs)
    base = {k: today_rule().accepted(s) for k, (_, s) in b_cal.items()}
    rule, table = search(c_cal, base)
    res["qualifying_rules"] = len(table)
    if rule is None:
        res["candidate_rule"] = None
        return res
    rule = Rule(rule.min_cosine, rule.min_prob, rule.cross_weight, derive_sure(c_cal, rule))
    res["candidate_rule"] = rule.__dict__
    say(f"candidate rule from calibration: {rule}")
    b_held, c_held = scored_sets(before, held, vecs), scored_sets(cand, held, vecs)
    for part, b, c in (("calibration", b_cal, c_cal), ("heldout", b_held, c_held)):
        res[part] = {"today": report(b, today_rule()), "candidate": report(c, rule)}
    return res
