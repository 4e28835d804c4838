"""Semantic-cache verifier: decides whether a stored query may answer a new one.

Cosine similarity alone tops out near 0.93 precision on QQP because hard negatives share most words
("best phone under 15000" vs "under 20000"). A hit therefore needs three things, checked in order:

1. the candidate's cosine clears ``DEFAULT_RULE.min_cosine`` (cheap pre-filter, the ANN threshold);
2. no hard guard fires (numbers, negation, antonyms, script, swap, time: ``guard_reason``);
3. a small MLP over pair features gives probability >= ``DEFAULT_RULE.min_prob``; with the optional
   cross-encoder stage (a ``PairScorer``: ``embeddings/cross_onnx.py``, given by
   ``gateway/cache/verifier_loader.py``), the geometric mean of the MLP's and the cross-encoder's
   probabilities must clear it instead.

The MLP is numpy only; training uses torch (``train_verifier`` / ``cachegw train-verifier``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cachegw.policies.pair_diff import Alignment
from cachegw.policies.pair_guards import guard_reason
from cachegw.policies.quantities import warm
from cachegw.policies.verifier_features import pair_features

log = logging.getLogger(__name__)

ARTIFACT_PATH = Path(__file__).resolve().parent / "artifacts" / "verifier.npz"
FORMAT_VERSION = 1
_PARAM_KEYS = ("mean", "std", "w1", "b1", "w2", "b2")


@dataclass(frozen=True)
class DecisionRule:
    """The gateway's hit rule: cosine pre-filter AND verifier probability (guards force it to 0)."""

    # Chosen on the validation part of the QQP training split (never the test split). The cosine floor: a
    # high one costs QQP nothing and keeps the QQP-trained models from reviving low-cosine pairs on other
    # domains. min_prob applies to the final probability (MLP x cross-encoder geometric mean): the highest
    # validation precision whose validation recall stays >= 0.35 (0.899 / 0.379), the same margin over
    # the 0.3 target as the MLP-only rule had, because test recall ran ~0.05 below validation recall.
    min_cosine: float = 0.88
    min_prob: float = 0.80
    # A pair whose MLP probability reaches ``sure`` is accepted without asking the cross-encoder (2.0:
    # always ask). Only for a fixed ``min_prob``: a bound's line (min_prob 0) needs the real score.
    sure: float = 2.0

    def decide(self, cosine: float, prob: float) -> bool:
        return cosine >= self.min_cosine and prob >= self.min_prob


# The one place the default setting lives; bench/verifier_quality.py measures exactly this.
DEFAULT_RULE = DecisionRule()


@dataclass(frozen=True)
class Verdict:
    """Outcome of one check, with the reason so the gateway can count rejections by cause."""

    accepted: bool
    prob: float
    cosine: float
    # "hit", "low_cosine", "low_prob", "guard:<name>", or from the alignment (policies/pair_diff.py):
    # "context-differs", "guard:code", "guard:polarity"
    reason: str


class VerifierDataError(ValueError):
    """Training CSV is missing, empty or malformed; the message is meant for the user."""


def _as_matrix(emb: np.ndarray, n: int) -> np.ndarray:
    m = np.asarray(emb, dtype=np.float32).reshape(n, -1)
    norms = np.linalg.norm(m, axis=1, keepdims=True)
    return m / np.maximum(norms, 1e-12)


class PairScorer(Protocol):
    """A second stage that reads both questions together (``embeddings.cross_onnx.CrossScorer``)."""

    def score_batch(self, q_new: list[str], q_old: list[str]) -> np.ndarray: ...


class Verifier:
    """Pair classifier (2-layer MLP) plus hard guards, and optionally a cross-encoder stage."""

    def __init__(
        self, params: dict[str, np.ndarray], meta: dict[str, Any], cross: PairScorer | None = None
    ) -> None:
        missing = [k for k in _PARAM_KEYS if k not in params]
        if missing:
            raise ValueError(f"verifier artifact lacks arrays {missing}")
        self.params = {k: np.asarray(params[k], dtype=np.float32) for k in _PARAM_KEYS}
        self.meta = meta
        self.cross = cross
        self.units = True  # numbers compared as values with units; False: as digit strings (before)
        self._inv_std = 1.0 / self.params["std"]

    @classmethod
    def load(cls, path: str | Path | None = None, cross: PairScorer | None = None) -> Verifier:
        """Load an artifact written by ``save``; ``None`` loads the one shipped with the package."""
        p = Path(path) if path is not None else ARTIFACT_PATH
        with np.load(p, allow_pickle=False) as z:
            params = {k: z[k] for k in _PARAM_KEYS if k in z}
            meta = json.loads(str(z["meta_json"])) if "meta_json" in z else {}
        if meta.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
            raise ValueError(f"{p}: unsupported verifier format {meta.get('format_version')}")
        log.info("loaded verifier %s (%d features)", p, params["mean"].shape[0])
        warm()  # the unit registry, read on the first query naming a unit otherwise
        return cls(params, meta, cross)

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        meta = {**self.meta, "format_version": FORMAT_VERSION}
        with open(p, "wb") as f:  # a file object stops numpy from appending ".npz" to other suffixes
            np.savez_compressed(f, meta_json=np.array(json.dumps(meta)), **self.params)

    def _mlp(self, feats: np.ndarray) -> np.ndarray:
        p = self.params
        h = np.maximum((feats - p["mean"]) * self._inv_std @ p["w1"] + p["b1"], 0.0)
        z = (h @ p["w2"]).reshape(-1) + p["b2"]
        return 1.0 / (1.0 + np.exp(-np.clip(z, -30.0, 30.0)))

    def score_batch(
        self, q_new: list[str], q_old: list[str], emb_new: np.ndarray, emb_old: np.ndarray
    ) -> np.ndarray:
        """Probability that each (new, old) pair asks the same question; 0.0 where a guard fires."""
        n = len(q_new)
        if n != len(q_old):
            raise ValueError("q_new and q_old differ in length")
        out = np.zeros(n, dtype=np.float32)
        keep = [i for i in range(n) if guard_reason(q_new[i], q_old[i], self.units) is None]
        if keep:
            u, v = _as_matrix(emb_new, n)[keep], _as_matrix(emb_old, n)[keep]
            a, b = [q_new[i] for i in keep], [q_old[i] for i in keep]
            out[keep] = self._combine(a, b, self._mlp(pair_features(a, b, u, v)))
        return out

    def _combine(
        self,
        a: list[str],
        b: list[str],
        p_mlp: np.ndarray,
        min_prob: float = 0.0,
        cross: bool = True,
        sure: float = 2.0,
    ) -> np.ndarray:
        """The final probability: the MLP's, or its geometric mean with the cross-encoder's.

        A pair whose MLP probability is under ``min_prob ** 2`` cannot reach ``min_prob`` whatever the
        cross-encoder says, so it is not sent there; it keeps the upper bound ``sqrt(p_mlp)`` instead.
        So does a pair at or over ``sure`` (with ``min_prob`` > 0): on the calibration data the
        cross-encoder never turned such a pair into a wrong refusal or acceptance (docs/verifier.md).
        The cross-encoder reads each pair in one fixed order (the smaller text first): it is not
        symmetric, and on QQP its verdict flipped with the order for 8% of candidates, so whether a
        paraphrase hit depended on which of the two queries had come first.
        """
        if self.cross is None or not cross:
            return p_mlp
        out = np.sqrt(p_mlp).astype(np.float32)
        ask = np.flatnonzero((p_mlp >= min_prob**2) & ((p_mlp < sure) | (min_prob <= 0)))
        if len(ask):
            pairs = [(a[i], b[i]) if a[i] <= b[i] else (b[i], a[i]) for i in ask]
            p_cross = self.cross.score_batch([x for x, _ in pairs], [y for _, y in pairs])
            out[ask] = np.sqrt(p_mlp[ask] * p_cross)
        return out

    def score(self, q_new: str, q_old: str, emb_new: np.ndarray, emb_old: np.ndarray) -> float:
        return float(self.score_batch([q_new], [q_old], emb_new, emb_old)[0])

    def check_batch(
        self,
        q_new: list[str],
        q_old: list[str],
        emb_new: np.ndarray,
        emb_old: np.ndarray,
        rule: DecisionRule = DEFAULT_RULE,
        cross: bool = True,
    ) -> list[Verdict]:
        """Full decision with reasons; pairs under the cosine pre-filter skip the MLP. ``cross=False``
        leaves the cross-encoder out (the MLP's probability alone is compared with ``min_prob``)."""
        n = len(q_new)
        u, v = _as_matrix(emb_new, n), _as_matrix(emb_old, n)
        cos = np.einsum("ij,ij->i", u, v)
        verdicts: list[Verdict | None] = [None] * n
        todo = []
        for i in range(n):
            guard = guard_reason(q_new[i], q_old[i], self.units)
            if cos[i] < rule.min_cosine:
                verdicts[i] = Verdict(False, 0.0, float(cos[i]), "low_cosine")
            elif guard is not None:
                verdicts[i] = Verdict(False, 0.0, float(cos[i]), f"guard:{guard}")
            else:
                todo.append(i)
        if todo:
            a, b = [q_new[i] for i in todo], [q_old[i] for i in todo]
            p_mlp = self._mlp(pair_features(a, b, u[todo], v[todo]))
            probs = self._combine(a, b, p_mlp, rule.min_prob, cross, rule.sure)
            for i, prob in zip(todo, probs, strict=True):
                ok = rule.decide(float(cos[i]), float(prob))
                verdicts[i] = Verdict(ok, float(prob), float(cos[i]), "hit" if ok else "low_prob")
        return [v for v in verdicts if v is not None]

    def check_aligned(
        self, al: Alignment, emb_new: np.ndarray, emb_old: np.ndarray, rule: DecisionRule = DEFAULT_RULE
    ) -> Verdict:
        """The verdict on one pair after ``pair_diff.align``: equal texts hit, a refused alignment misses
        with its reason, and otherwise the guards and models judge the focus. ``emb_new`` / ``emb_old``
        are the focus texts' embeddings (the whole texts' when ``al.reembed`` is false).

        A focus that is part of a longer message (an instruction over a document or code) is judged by
        the MLP alone: the cross-encoder learned QQP's questions and refuses light rewordings of an
        instruction ("What is the tone of this text?" / "What's the tone...": 0.49); on the families'
        tune split it added no true refusal there (docs/verifier.md)."""
        if al.outcome == "same":
            return Verdict(True, 1.0, 1.0, "hit")
        if al.outcome == "refuse":
            return Verdict(False, 0.0, 0.0, al.reason)
        return self.check_batch([al.focus_new], [al.focus_old], emb_new, emb_old, rule, not al.reembed)[0]

    def without_cross(
        self, al: Alignment, emb_new: np.ndarray, emb_old: np.ndarray, rule: DecisionRule = DEFAULT_RULE
    ) -> Verdict | None:
        """``check_aligned``'s verdict when it needs no cross-encoder call, else None: the caller keeps
        these cases (most hits, with ``rule.sure``) on its own thread and sends only the rest to a worker."""
        if self.cross is None or al.outcome != "judge" or al.reembed:
            return self.check_aligned(al, emb_new, emb_old, rule)
        mlp = self.check_batch([al.focus_new], [al.focus_old], emb_new, emb_old, rule, cross=False)[0]
        if mlp.reason not in ("hit", "low_prob"):  # under the cosine floor, or a guard
            return mlp
        if mlp.prob < rule.min_prob**2 or (rule.min_prob > 0 and mlp.prob >= rule.sure):
            prob = float(np.sqrt(np.float32(mlp.prob)))  # what _combine gives a pair it does not send
            ok = rule.decide(mlp.cosine, prob)
            return Verdict(ok, prob, mlp.cosine, "hit" if ok else "low_prob")
        return None

    def accept_batch(
        self,
        q_new: list[str],
        q_old: list[str],
        emb_new: np.ndarray,
        emb_old: np.ndarray,
        threshold: float | None = None,
        min_cosine: float | None = None,
    ) -> list[bool]:
        """True where the pair is a cache hit under the default rule (overridable per call)."""
        rule = DecisionRule(
            min_cosine=DEFAULT_RULE.min_cosine if min_cosine is None else min_cosine,
            min_prob=DEFAULT_RULE.min_prob if threshold is None else threshold,
        )
        return [v.accepted for v in self.check_batch(q_new, q_old, emb_new, emb_old, rule)]

    def accept(
        self,
        q_new: str,
        q_old: str,
        emb_new: np.ndarray,
        emb_old: np.ndarray,
        threshold: float | None = None,
        min_cosine: float | None = None,
    ) -> bool:
        return self.accept_batch([q_new], [q_old], emb_new, emb_old, threshold, min_cosine)[0]
