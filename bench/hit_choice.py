"""What a semantic hit runs, chosen on held-out data: the query encoder and the verifier's stages,
for quality per family and for CPU per hit.

    .venv/bin/python -m bench.hit_choice [--sample 200]

Candidates, all shipped offline with the gateway's own files:
- encoders: all-MiniLM-L6-v2 on ONNX Runtime in float32 (before), and the same graph with int8 weights
  (per channel, each query run alone: dynamic quantization scales activations per call);
- verifier: guards + MLP + cross-encoder (before); the MLP alone; and the cross-encoder skipped where
  the MLP is sure (``p_mlp >= sure``), with ``sure`` derived on the calibration sets only.

Calibration sets (rules are derived here and nowhere else): the families' ``tune`` split, the
calibration half of QQP's test split and of banking77 (``bench/prior_split.py``; the verifier never
trained on either). Held out (reported only): the families' ``heldout`` split, QQP's and banking77's
held-out halves. Every pair goes through the semantic tier's own steps: ``pair_diff.align``, then the
verifier on the focus (re-embedded when it is part of a longer message, where no cross-encoder runs).
Writes bench/results/hit_choice.json.

With ``--candidate-mlp`` / ``--candidate-cross`` (other artifacts) or ``--before-rev`` (today's artifacts
from an earlier revision, once a candidate ships), it adds the candidate column: the funnel of today's
rule on the calibration sets, the candidate's rule chosen on calibration sets only, and both held out
(``bench/recall_choice.py``).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS, SHARED_DATA, machine, save, say
from bench.prior_split import banking_parts, nearest_pairs, qqp_parts, read
from cachegw.embeddings.onnx_encoder import OnnxEncoder
from cachegw.gateway.cache.verifier_loader import load_verifier
from cachegw.gateway.config import load_settings
from cachegw.policies.pair_diff import align
from cachegw.policies.pair_guards import guard_reason
from cachegw.policies.verifier import DEFAULT_RULE, DecisionRule, Verifier
from cachegw.policies.verifier_features import pair_features

FAMILIES = Path(__file__).resolve().parent / "data" / "verifier_families.jsonl"
LOCK = "/tmp/cachegw-bench.lock"
WIDE = DecisionRule(min_cosine=0.85, min_prob=0.74)  # the loosest rule searched: scores kept down to it
FLOOR_GRID = np.round(np.arange(0.85, 0.8801, 0.005), 3)
PROB_GRID = np.round(np.arange(0.74, 0.8001, 0.01), 2)
SURE_GRID = np.round(np.arange(0.64, 1.0001, 0.005), 3)


@dataclass
class Pairs:
    q1: list[str]
    q2: list[str]
    y: np.ndarray


@dataclass
class Scored:
    """Each pair's path through the tier: decided by the alignment (same / refused), or judged."""

    fixed: np.ndarray  # bool: decided before any model (same: accept; refused: reject)
    fixed_accept: np.ndarray
    partial: np.ndarray  # judged on a focus inside longer messages (MLP only)
    cos: np.ndarray
    guarded: np.ndarray
    p_mlp: np.ndarray
    p_cross: np.ndarray  # nan where the cross-encoder was not asked


def pair_sets() -> tuple[dict[str, Pairs], dict[str, Pairs]]:
    """(calibration, held out) sets by name."""
    calib: dict[str, Pairs] = {}
    held: dict[str, Pairs] = {}
    rows = [json.loads(line) for line in FAMILIES.open(encoding="utf-8")]
    for fam in sorted({r["family"] for r in rows}):
        for split, dest in (("tune", calib), ("heldout", held)):
            sel = [r for r in rows if r["family"] == fam and r["split"] == split]
            dest[fam] = Pairs(
                [r["question1"] for r in sel],
                [r["question2"] for r in sel],
                np.array([r["label"] == 1 for r in sel]),
            )
    c_rows, h_rows = qqp_parts(read(SHARED_DATA, "qqp_dev.csv"))
    for rows_, dest in ((c_rows, calib), (h_rows, held)):
        dest["qqp"] = Pairs(
            [r["question1"] for r in rows_],
            [r["question2"] for r in rows_],
            np.array([r["is_duplicate"] == "1" for r in rows_]),
        )
    b_calib, b_held = banking_parts(read(SHARED_DATA, "banking77_train.csv"))
    for rows_, dest in ((b_calib, calib), (b_held, held)):
        q1, q2, y = nearest_pairs(rows_)
        dest["banking77"] = Pairs(q1, q2, y)
    return calib, held


def embed_all(enc: Any, texts: list[str], name: str) -> dict[str, np.ndarray]:
    """Every text's vector, kept under the temp dir per encoder (a rerun skips minutes of embedding)."""
    uniq = sorted(set(texts))
    key = hashlib.sha1("\n".join(uniq).encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"cachegw-hit-choice-{name}-{key}.npy"
    if path.exists():
        emb = np.load(path)
    else:
        emb = enc.encode(uniq)
        np.save(path, emb)
    return {t: emb[i] for i, t in enumerate(uniq)}


def score(
    v: Verifier,
    ps: Pairs,
    vecs: dict[str, np.ndarray],
    cross_cache: dict[tuple[str, str], float],
    rule: DecisionRule = WIDE,
) -> Scored:
    """Scores kept for every rule at least as loose as ``rule`` (cosine floor, and the cross-encoder
    asked where ``p_mlp >= rule.min_prob ** 2``)."""
    n = len(ps.y)
    flags = [np.zeros(n, dtype=bool) for _ in range(4)]
    s = Scored(flags[0], flags[1], flags[2], np.zeros(n), flags[3], np.zeros(n), np.full(n, np.nan))
    for i, (a, b) in enumerate(zip(ps.q1, ps.q2, strict=True)):
        al = align(a, b)
        if al.outcome != "judge":
            s.fixed[i], s.fixed_accept[i] = True, al.outcome == "same"
            continue
        fa, fb = al.focus_new, al.focus_old
        u, w = (vecs[fa], vecs[fb]) if al.reembed else (vecs[a], vecs[b])
        s.partial[i] = al.reembed
        s.cos[i] = float(u @ w)
        s.guarded[i] = guard_reason(fa, fb, v.units) is not None
        if s.cos[i] < rule.min_cosine or s.guarded[i]:
            continue
        s.p_mlp[i] = float(v._mlp(pair_features([fa], [fb], u[None], w[None]))[0])
        if not al.reembed and s.p_mlp[i] >= rule.min_prob**2 and v.cross is not None:
            key = (fa, fb) if fa <= fb else (fb, fa)
            if key not in cross_cache:
                cross_cache[key] = float(v.cross.score_batch([key[0]], [key[1]])[0])
            s.p_cross[i] = cross_cache[key]
    return s


def accepted(s: Scored, mode: str, sure: float = 2.0, rule: DecisionRule = DEFAULT_RULE) -> np.ndarray:
    """Verdicts under one setting: ``full`` (MLP + cross-encoder), ``mlp`` (MLP alone), ``skip``
    (the cross-encoder left out where ``p_mlp >= sure``)."""
    judged = ~s.fixed & (s.cos >= rule.min_cosine) & ~s.guarded
    if mode == "mlp":
        ok = s.p_mlp >= rule.min_prob
    else:
        comb = np.where(np.isnan(s.p_cross), np.sqrt(s.p_mlp), np.sqrt(s.p_mlp * np.nan_to_num(s.p_cross)))
        whole = np.where(np.isnan(s.p_cross), False, comb >= rule.min_prob)
        ok = np.where(s.partial, s.p_mlp >= rule.min_prob, whole)
        if mode == "skip":
            ok = ok | (~s.partial & (s.p_mlp >= sure))
    return (s.fixed & s.fixed_accept) | (judged & ok)


def cross_calls(s: Scored, mode: str, sure: float = 2.0, rule: DecisionRule = DEFAULT_RULE) -> int:
    """Cross-encoder calls the setting makes (pairs at its floor, unguarded, MLP over min_prob**2)."""
    asked = ~np.isnan(s.p_cross) & (s.cos >= rule.min_cosine) & (s.p_mlp >= rule.min_prob**2)
    return int((asked & (s.p_mlp < sure)).sum()) if mode == "skip" else int(asked.sum()) * (mode == "full")


def derive_rule(
    calib: dict[str, tuple[Pairs, Scored]], before: dict[str, tuple[Pairs, Scored]]
) -> DecisionRule | None:
    """On the calibration sets only: the (cosine floor, min_prob) under which this encoder's verdicts
    have no more false hits and no lower recall than ``before``'s at the default rule, on every set;
    of those, the fewest false hits in all, then the most right hits. None: no rule on the grid does."""
    best: tuple[int, int, DecisionRule] | None = None
    for floor in FLOOR_GRID:
        for p in PROB_GRID:
            rule = DecisionRule(min_cosine=float(floor), min_prob=float(p))
            fp = tp = 0
            ok = True
            for k, (ps, s) in calib.items():
                acc, acc0 = accepted(s, "full", rule=rule), accepted(before[k][1], "full")
                f, t = int((acc & ~ps.y).sum()), int((acc & ps.y).sum())
                ok = ok and f <= int((acc0 & ~ps.y).sum()) and t >= int((acc0 & ps.y).sum())
                fp, tp = fp + f, tp + t
            if ok and (best is None or (fp, -tp) < best[:2]):
                best = (fp, -tp, rule)
    return None if best is None else best[2]


def derive_sure(
    calib: dict[str, tuple[Pairs, Scored]], rule: DecisionRule = DEFAULT_RULE
) -> dict[str, float]:
    """On the calibration sets only: ``strict``, the lowest ``sure`` at which skipping changes no
    verdict; ``no_false_hit``, the lowest at which it adds no wrong answer (the cross-encoder's refusals
    above it were all of right pairs)."""
    out = {}
    tests = {"strict": lambda y, d: not d.any(), "no_false_hit": lambda y, d: not (d & ~y).any()}
    sets = list(calib.values())
    for name, harmless in tests.items():
        best = 1.0
        for t in SURE_GRID[::-1]:
            changed = [
                accepted(s, "skip", t, rule) ^ accepted(s, "full", rule=rule) for _, s in calib.values()
            ]
            if all(harmless(ps.y, d) for (ps, _), d in zip(sets, changed, strict=True)):
                best = float(t)
            else:
                break
        out[name] = best
    return out


def prf(y: np.ndarray, acc: np.ndarray) -> dict[str, Any]:
    tp, fp = int((acc & y).sum()), int((acc & ~y).sum())
    return {
        "precision": round(tp / (tp + fp), 4) if tp + fp else None,
        "recall": round(tp / max(int(y.sum()), 1), 4),
        "true_hits": tp,
        "false_hits": fp,
        "positives": int(y.sum()),
        "negatives": int((~y).sum()),
    }


def cpu_ms(encoders: dict[str, Any], v: Verifier, ps: Pairs, sample: int) -> dict[str, Any]:
    """Per query, interleaved: each encoder's ms for one text alone; MLP + guards + alignment; one
    cross-encoder call. Medians over ``sample`` QQP questions."""
    rng = np.random.default_rng(0)
    idx = rng.choice(len(ps.q1), size=min(sample, len(ps.q1)), replace=False)
    t: dict[str, list[float]] = {**{f"embed:{k}": [] for k in encoders}, "align+guards+mlp": [], "cross": []}
    for i in idx:
        a, b = ps.q1[i], ps.q2[i]
        for k, enc in encoders.items():
            t0 = time.perf_counter()
            e = enc.encode([a])
            t[f"embed:{k}"].append((time.perf_counter() - t0) * 1e3)
        f = encoders[next(iter(encoders))].encode([b])
        t0 = time.perf_counter()
        align(a, b)
        guard_reason(a, b, v.units)
        v._mlp(pair_features([a], [b], e, f))
        t["align+guards+mlp"].append((time.perf_counter() - t0) * 1e3)
        if v.cross is not None:
            t0 = time.perf_counter()
            v.cross.score_batch([a], [b])
            t["cross"].append((time.perf_counter() - t0) * 1e3)
    return {k: round(float(np.median(x)), 3) for k, x in t.items() if x}


def candidate_column(
    args: argparse.Namespace, vecs: dict[str, np.ndarray], calib: dict[str, Pairs], held: dict[str, Pairs]
) -> dict[str, Any]:
    """Today's artifacts (``--before-rev``, else the shipped ones) against the candidate's, each at its
    own rule, the candidate's chosen on calibration sets only (``bench/recall_choice.py``)."""
    from bench.recall_choice import CROSS_FILE, MLP_FILE, artifacts_at, evaluate, verifier
    from bench.recall_pairs import calibration_sets

    root = Path(__file__).resolve().parents[1]
    shipped = (root / MLP_FILE, root / CROSS_FILE)
    b_mlp, b_cross = artifacts_at(args.before_rev) if args.before_rev else shipped
    c_mlp, c_cross = args.candidate_mlp or root / MLP_FILE, args.candidate_cross or root / CROSS_FILE
    c_calib, _ = calibration_sets()
    res = evaluate(verifier(b_mlp, b_cross), verifier(c_mlp, c_cross), calib, c_calib, held, vecs)
    return {"before_rev": args.before_rev, "candidate": [str(c_mlp), str(c_cross)], **res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sample", type=int, default=200, help="questions timed per stage")
    ap.add_argument("--no-timing", action="store_true", help="quality only (no wait for the bench lock)")
    ap.add_argument("--timing-only", action="store_true", help="add the timing to the last results")
    ap.add_argument("--before-rev", help="revision whose verifier artifacts are today's")
    ap.add_argument("--candidate-mlp", type=Path, help="candidate MLP artifact (default: the shipped one)")
    ap.add_argument("--candidate-cross", type=Path, help="candidate cross-encoder (default: the shipped one)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    v = load_verifier(load_settings(None).cache)
    encoders = {"l6-fp32": OnnxEncoder().load(), "l6-int8": OnnxEncoder(int8=True).load()}
    if args.timing_only:  # run under the bench lock by its caller
        _, rows = qqp_parts(read(SHARED_DATA, "qqp_dev.csv"))
        qqp = Pairs([r["question1"] for r in rows], [r["question2"] for r in rows], np.zeros(len(rows), bool))
        last = json.loads((RESULTS / "hit_choice.json").read_text())
        last["cpu_ms_per_query"] = cpu_ms(encoders, v, qqp, args.sample)
        last["timing_load_average"] = os.getloadavg()
        save("hit_choice", {k: x for k, x in last.items() if k != "machine"})
        say(json.dumps(last["cpu_ms_per_query"]))
        return
    say("pair sets")
    calib, held = pair_sets()
    texts: list[str] = []
    for ps in [*calib.values(), *held.values()]:
        for a, b in zip(ps.q1, ps.q2, strict=True):
            al = align(a, b)
            texts += [a, b] + ([al.focus_new, al.focus_old] if al.outcome == "judge" and al.reembed else [])
    cross_cache: dict[tuple[str, str], float] = {}
    results: dict[str, Any] = {"machine": machine(), "rule": DEFAULT_RULE.__dict__, "encoders": {}}
    first: dict[str, tuple[Pairs, Scored]] = {}
    vecs_by_encoder: dict[str, dict[str, np.ndarray]] = {}
    for name, enc in encoders.items():
        say(f"{name}: embedding {len(set(texts)):,} texts")
        vecs = embed_all(enc, texts, name)
        sc_calib = {k: (ps, score(v, ps, vecs, cross_cache)) for k, ps in calib.items()}
        sc_held = {k: (ps, score(v, ps, vecs, cross_cache)) for k, ps in held.items()}
        first = first or sc_calib
        rules = {"default": DEFAULT_RULE}
        if sc_calib is not first and (fitted := derive_rule(sc_calib, first)) is not None:
            rules["refitted"] = fitted  # thresholds of its own, from the calibration sets
        res: dict[str, Any] = {"rules": {}, "calibration": {}, "heldout": {}}
        settings: dict[str, tuple[str, float, DecisionRule]] = {}
        for rname, rule in rules.items():
            sure = derive_sure(sc_calib, rule)
            say(f"{name}: rule {rname} {rule}, sure {sure}")
            res["rules"][rname] = {**rule.__dict__, "sure_from_calibration": sure}
            settings[f"{rname}"] = ("full", 2.0, rule)
            settings[f"{rname}+mlp-only"] = ("mlp", 2.0, rule)
            settings.update({f"{rname}+skip@{k}": ("skip", t, rule) for k, t in sure.items()})
        for part, sets in (("calibration", sc_calib), ("heldout", sc_held)):
            for k, (ps, s) in sets.items():
                res[part][k] = {
                    label: {**prf(ps.y, accepted(s, m, t, r)), "cross_calls": cross_calls(s, m, t, r)}
                    for label, (m, t, r) in settings.items()
                }
        results["encoders"][name] = res
        vecs_by_encoder[name] = vecs
    if args.before_rev or args.candidate_mlp or args.candidate_cross:
        results["candidate"] = candidate_column(args, vecs_by_encoder["l6-fp32"], calib, held)
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    save("hit_choice", results)  # the quality figures, before the wait for the lock
    if args.no_timing:
        return
    say("timing (waits for the bench lock)")
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # only the timed part holds it
        results["cpu_ms_per_query"] = cpu_ms(encoders, v, held["qqp"], args.sample)
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    save("hit_choice", results)
    say(json.dumps(results["cpu_ms_per_query"]))


if __name__ == "__main__":
    main()
