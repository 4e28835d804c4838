"""Seed the false-hit evidence from labelled pairs (``cachegw calibrate --seed-evidence MODEL``), so a
new deployment's error bound starts from its own traffic's labels rather than from nothing.

Each pair is scored as the semantic tier scores a candidate: the gateway's query text, embedded by its
encoder; a pair under the cosine threshold or stopped by a guard is no candidate and no evidence; the
score is the verifier's final probability (the cosine with the verifier off). A duplicate is a right
hit, a non-duplicate a wrong one.
"""

from __future__ import annotations

import time

import numpy as np

from cachegw.gateway.offline.calibrate import gateway_encoder, gateway_query
from cachegw.gateway.storage.evidence_store import EvidenceRow, EvidenceStore
from cachegw.policies.canonicalize import CanonicalizeConfig
from cachegw.policies.verifier import DecisionRule, Verifier


def seed_scores(
    q1: list[str],
    q2: list[str],
    cfg: CanonicalizeConfig,
    verifier: Verifier | None,
    threshold: float,
    backend: str = "auto",
    int8: bool = False,
) -> np.ndarray:
    """Per pair, its score as a candidate, NaN where it would be none."""
    a, b = [gateway_query(q, cfg) for q in q1], [gateway_query(q, cfg) for q in q2]
    ok = [i for i in range(len(a)) if a[i] is not None and b[i] is not None]
    ua, ub = [str(a[i]) for i in ok], [str(b[i]) for i in ok]
    texts = sorted(set(ua) | set(ub))
    emb = gateway_encoder(backend, int8).encode(texts)
    row = {t: i for i, t in enumerate(texts)}
    ea, eb = emb[[row[t] for t in ua]], emb[[row[t] for t in ub]]
    out = np.full(len(q1), np.nan)
    if verifier is None:
        cos = np.einsum("ij,ij->i", ea, eb)
        out[ok] = np.where(cos >= threshold, cos, np.nan)
        return out
    verdicts = verifier.check_batch(ua, ub, ea, eb, DecisionRule(min_cosine=threshold, min_prob=0.0))
    out[ok] = [v.prob if v.accepted else np.nan for v in verdicts]
    return out


def seed(store: EvidenceStore, model: str, tenant: str, scores: np.ndarray, labels: np.ndarray) -> int:
    """Write the candidates' rows (source "seed"); returns how many."""
    now = time.time()
    rows = [
        EvidenceRow(model, tenant, float(s), bool(y), "seed", now)
        for s, y in zip(scores, labels, strict=True)
        if not np.isnan(s)
    ]
    if rows:
        store.add(rows)
    return len(rows)
