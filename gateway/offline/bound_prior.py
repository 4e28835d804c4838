"""Write a false-hit prior (``cachegw calibrate --pairs FILE --write-prior PATH``): labelled pairs
scored as the semantic tier scores candidates (``evidence_seed.seed_scores``), counted per grid cell,
with where they came from, so a new deployment's bound can serve from its first hour
(``policies/bound_prior.py``; the gateway reads it through ``[cache.error_bound] false_hit_prior``).

Two kinds of score are counted, since the line is drawn on whichever the gateway thresholds: the
verifier's final probability ("verifier") and the cosine with the verifier off ("cosine").
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from cachegw.embeddings.cross_encoder import ARTIFACT_PATH as CROSS_PATH
from cachegw.gateway.offline.evidence_seed import seed_scores
from cachegw.policies.bound_prior import PriorCounts
from cachegw.policies.error_bound import GRID
from cachegw.policies.verifier import ARTIFACT_PATH as VERIFIER_PATH
from cachegw.policies.verifier import Verifier

ENCODER = "sentence-transformers/all-MiniLM-L6-v2"  # the bundled query encoder (embeddings/encoder.py)


def sha256(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def first_candidates(scores: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Only each query's first candidate kept (NaN elsewhere): pairs come nearest first, and the
    semantic tier judges a query's neighbours in that order, serving the first its guards and
    verifier accept."""
    out = np.full(len(scores), np.nan)
    seen: set[int] = set()
    for i, (s, q) in enumerate(zip(scores, query, strict=True)):
        if not np.isnan(s) and int(q) not in seen:
            seen.add(int(q))
            out[i] = s
    return out


def prior_counts(
    q1: list[str],
    q2: list[str],
    right: np.ndarray,
    settings: Any,
    verifier: Verifier | None,
    query: np.ndarray | None = None,
) -> dict[str, PriorCounts]:
    """Per score kind, the pairs' counts (the "verifier" kind only with a verifier). ``query``: which
    query each pair's first question is (pairs of one query nearest first); only its first candidate
    counts (``first_candidates``). None: every pair is a query of its own."""
    c = settings.cache
    kinds: dict[str, Verifier | None] = {"cosine": None}
    if verifier is not None:
        kinds["verifier"] = verifier
    out = {}
    for kind, v in kinds.items():
        scores = seed_scores(q1, q2, settings.canonicalize, v, c.threshold, c.encoder.backend)
        out[kind] = PriorCounts.from_scores(
            scores if query is None else first_candidates(scores, query), right
        )
    return out


def prior_document(
    counts: dict[str, PriorCounts],
    settings: Any,
    provenance: dict[str, Any],
    families: dict[str, dict[str, PriorCounts]] | None = None,
) -> dict:
    """The file's content: the grid, the counts per kind, and their provenance (hashes of the
    verifier and cross-encoder artifacts that scored them, the date, the command, the data);
    ``families``: the same counts kept apart per calibration family (the gateway weighs them per
    scope: ``policies/prior_families.py``)."""
    v = settings.cache.verifier
    verifier_file = Path(v.path or VERIFIER_PATH)
    cross_file = Path(v.cross_verifier_path or CROSS_PATH)
    return {
        "grid": list(GRID),
        "kinds": {k: {"audits": list(p.audits), "wrong": list(p.wrong)} for k, p in counts.items()},
        **(
            {
                "families": {
                    name: {k: {"audits": list(p.audits), "wrong": list(p.wrong)} for k, p in kinds.items()}
                    for name, kinds in families.items()
                }
            }
            if families
            else {}
        ),
        "provenance": {
            "date": datetime.date.today().isoformat(),
            "command": " ".join(sys.argv),
            "encoder": ENCODER,
            "cosine_threshold": settings.cache.threshold,
            "verifier_sha256": sha256(verifier_file),
            "cross_encoder_sha256": sha256(cross_file) if v.cross_verifier else None,
            "candidates": {k: p.total for k, p in counts.items()},
            **provenance,
        },
    }


def write_prior(path: Path | str, document: dict) -> None:
    Path(path).write_text(json.dumps(document, indent=1) + "\n")
