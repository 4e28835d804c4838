"""Every candidate pair the held-out QQP replay (``bench.error_bound --prior``) can put before its bound.

The semantic tier embeds each request's query text (``gateway_query``), takes the stored queries of its
scope at or over the cosine floor (``[cache] threshold``) nearest first, and scores each with
``pair_diff.align`` and the verifier (``check_aligned``, min_prob 0 as under a bound's line); a
candidate the line refuses passes the turn to the next one. Which entries are stored when depends on
which requests hit (a hit stores nothing) and on how four clients interleave, so this takes the
superset those cannot leave: every pair of distinct replayed query texts at or over the floor, scored
with the later one (in replay order) as the request. ``top4`` says whether the earlier one is among the
later one's 4 nearest earlier texts in a one-client replay where every request misses (the bound-off
run), the pairs the tier meets first.

Only pairs scoring at least ``GRID[0]`` (0.50) matter: a line is a point of the bound's grid, the lowest
0.50, and a candidate serves only at or over its scope's line (``ScopeLine.serves``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.error_bound import qqp_order


@dataclass(frozen=True)
class Candidate:
    """A pair of replayed questions the tier can score: ``request`` comes later in the replay."""

    request: str  # the question text as replayed
    stored: str
    request_ref: str  # "<QQP pair id>:<1|2>": where the text first occurs in the replay
    stored_ref: str
    cosine: float
    score: float  # the verifier's final probability (1.0 for texts equal up to whitespace)
    top4: bool
    request_index: int  # the request's position in the replay (0-based, two per pair)


def replay_candidates(data: Path, pairs: int, seed: int, min_score: float | None = None) -> list[Candidate]:
    """The candidates of the first ``pairs`` held-out pairs in replay order (seed ``seed``) scoring at
    least ``min_score`` (default: the grid's lowest line)."""
    from cachegw.gateway.cache.verifier_loader import load_verifier
    from cachegw.gateway.config import load_settings
    from cachegw.gateway.offline.calibrate import gateway_encoder, gateway_query
    from cachegw.policies.error_bound import GRID
    from cachegw.policies.pair_diff import align
    from cachegw.policies.verifier import DecisionRule

    lowest = GRID[0] if min_score is None else min_score
    settings = load_settings(None)
    c = settings.cache
    verifier = load_verifier(c, settings.engine.resolved_cache_dir)
    assert verifier is not None, "the replay runs with the shipped verifier"
    _, order = qqp_order(data, seed, held_out=True)
    texts: list[str] = []  # one per stored query key, first occurrence
    refs: list[str] = []
    at: list[int] = []
    keys: dict[str, int] = {}
    for n, (r, side) in enumerate((r, side) for r in order[:pairs] for side in (1, 2)):
        q = r[f"question{side}"]
        key = gateway_query(q, settings.canonicalize)
        if key is not None and key not in keys:  # a repeat is an exact hit, never a candidate
            keys[key] = len(texts)
            texts.append(q)
            refs.append(f"{r['id']}:{side}")
            at.append(n)
    key_list = list(keys)
    emb = gateway_encoder(c.encoder.backend, c.encoder.int8).encode(key_list)
    sims = emb @ emb.T
    rule = DecisionRule(min_cosine=c.threshold, min_prob=0.0)
    out = []
    for i in range(1, len(key_list)):
        earlier = sims[i, :i]
        nearest = set(np.argsort(-earlier)[:4].tolist())
        for j in np.flatnonzero(earlier >= c.threshold):
            al = align(key_list[i], key_list[j])
            if al.outcome == "judge" and al.reembed:
                u, v = gateway_encoder(c.encoder.backend, c.encoder.int8).encode([al.focus_new, al.focus_old])
            else:
                u, v = emb[i], emb[j]
            verdict = verifier.check_aligned(al, u[None], v[None], rule)
            if verdict.accepted and verdict.prob >= lowest:
                out.append(
                    Candidate(
                        texts[i], texts[j], refs[i], refs[j], float(sims[i, j]), float(verdict.prob),
                        int(j) in nearest, at[i],
                    )
                )  # fmt: skip
    return out
