"""Load the false-hit prior named by ``[cache.error_bound] false_hit_prior`` (at start): "shipped" (the
counts in ``policies/artifacts/bound_prior.json``), "none", or an operator's own file written by
``cachegw calibrate --write-prior``. A file that is missing or malformed stops the start with its
reason, rather than silently leaving new scopes without semantic hits.

A file may keep its calibration families apart (``families``: QQP questions, banking77 intents); each
scope then weighs them by its own audits (``policies/prior_families.py``). A file without them (an
operator's own pairs) is one family, "all"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cachegw.policies import bound_prior
from cachegw.policies.bound_prior import PriorCounts
from cachegw.policies.error_bound import GRID

SHIPPED = Path(bound_prior.__file__).resolve().parent / "artifacts" / "bound_prior.json"
Families = dict[str, PriorCounts]  # calibration family -> its counts
Priors = dict[str, Families]  # score kind ("verifier" or "cosine") -> its families


def _counts(c: dict[str, Any]) -> PriorCounts:
    return PriorCounts(tuple(map(float, c["audits"])), tuple(map(float, c["wrong"])))


def load_priors(setting: str) -> Priors:
    """The prior's counts per score kind and family ({} for "none")."""
    if setting == "none":
        return {}
    path = SHIPPED if setting == "shipped" else Path(setting)
    try:
        doc = json.loads(path.read_text())
        if [round(g, 2) for g in doc["grid"]] != list(GRID):
            raise ValueError("its grid is not the bound's 0.50, 0.51, ..., 1.00")
        families = doc.get("families") or {"all": doc["kinds"]}
        out: Priors = {}
        for family, kinds in families.items():
            for kind, c in kinds.items():
                out.setdefault(kind, {})[family] = _counts(c)
        return out
    except OSError as e:
        raise ValueError(f"false_hit_prior {path}: cannot read ({e.strerror})") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"false_hit_prior {path}: not a prior file ({type(e).__name__}: {e})") from None
