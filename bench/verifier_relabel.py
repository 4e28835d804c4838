"""How much of the verifier's QQP "precision" gap is the labels? A blind re-annotation of what it accepts.

Usage (from the project root):
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.verifier_relabel sample --out DIR   # pairs still to judge
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.verifier_relabel score              # the figures

``sample`` takes the pairs the shipped verifier accepts on the held-out QQP split (``split_qqp``), every one
labelled "not duplicate" (the false positives) and an equal number of randomly drawn labelled duplicates, and
writes those not judged yet into DIR/judge_in.csv (item, question_a, question_b; order within a pair
shuffled; no label, no score) for annotators. It appends them to ``bench/results/qqp_relabel/key.csv``
(item, QQP id, QQP label: ids only, the question texts stay in ../shared/data). Each annotator's answers go
to ``bench/results/qqp_relabel/judge_<name>.csv`` (item, duplicate, sure).

``score`` reports inter-annotator agreement (Cohen's kappa), how often the annotators call QQP's negatives
and positives duplicates, and the precision of each verifier setting against the labels the annotators agree
on: every false positive of the setting is judged; the true positives are a sample, so their rate is
estimated from it (95% bootstrap interval over both strata). Recall is not re-estimated (that would need
judging the negatives the verifier rejects) and stays on QQP's labels.
Writes bench/results/verifier_relabel.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import RESULTS as RESULTS_DIR  # noqa: E402
from bench.verifier_quality import CachedEncoder, _embed_pairs, _read_csv, split_qqp  # noqa: E402
from gateway.config import load_settings  # noqa: E402
from policies.verifier import DEFAULT_RULE, Verifier, load_verifier  # noqa: E402

RELABEL_DIR = RESULTS_DIR / "qqp_relabel"
KEY = RELABEL_DIR / "key.csv"


def accepted_sets(test: list[dict[str, str]]) -> dict[str, np.ndarray]:
    """Accepted mask on the test split for the shipped default (MLP + cross-encoder) and the MLP alone."""
    q1, q2 = [r["question1"] for r in test], [r["question2"] for r in test]
    e1, e2 = _embed_pairs(CachedEncoder(), q1, q2)
    out = {}
    for name, ver in (("default", load_verifier(load_settings(None).cache)), ("mlp_only", Verifier.load())):
        print(f"  scoring {len(q1):,} test pairs: {name}", flush=True)
        out[name] = np.array([v.accepted for v in ver.check_batch(q1, q2, e1, e2, DEFAULT_RULE)])
    return out


def read_key() -> list[dict[str, str]]:
    if not KEY.exists():
        return []
    with KEY.open(newline="") as f:
        return list(csv.DictReader(f))


def read_judges() -> dict[str, dict[str, int]]:
    """{annotator: {item: duplicate}} from every judge_<name>.csv."""
    out = {}
    for path in sorted(RELABEL_DIR.glob("judge_*.csv")):
        with path.open(newline="") as f:
            out[path.stem.removeprefix("judge_")] = {
                r["item"]: int(r["duplicate"]) for r in csv.DictReader(f)
            }
    return out


def sample(out_dir: Path, seed: int) -> int:
    _, test, _ = split_qqp(_read_csv("qqp_dev.csv"))
    sets = accepted_sets(test)
    y = np.array([r["is_duplicate"] == "1" for r in test])
    union = np.logical_or.reduce(list(sets.values()))
    key = read_key()
    judged = {k["qqp_id"] for k in key}
    fps = [i for i in np.flatnonzero(union & ~y) if test[i]["id"] not in judged]
    n_tp_judged = sum(1 for k in key if k["qqp_label"] == "1")
    n_fp_judged = sum(1 for k in key if k["qqp_label"] == "0") + len(fps)
    rng = random.Random(seed)
    pool = [i for i in np.flatnonzero(union & y) if test[i]["id"] not in judged]
    tps = rng.sample(pool, min(len(pool), max(0, n_fp_judged - n_tp_judged)))
    todo = fps + tps
    rng.shuffle(todo)
    start = max((int(k["item"]) for k in key), default=-1) + 1
    RELABEL_DIR.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    new_key = not KEY.exists()
    with KEY.open("a", newline="") as fk, (out_dir / "judge_in.csv").open("w", newline="") as fj:
        wk, wj = csv.writer(fk), csv.writer(fj)
        if new_key:
            wk.writerow(["item", "qqp_id", "qqp_label"])
        wj.writerow(["item", "question_a", "question_b"])
        for n, i in enumerate(todo, start):
            a, b = test[i]["question1"], test[i]["question2"]
            if rng.random() < 0.5:
                a, b = b, a
            wk.writerow([n, test[i]["id"], test[i]["is_duplicate"]])
            wj.writerow([n, a, b])
    print(f"{len(todo)} new pairs to judge ({len(fps)} QQP negatives, {len(tps)} positives) -> {out_dir}")
    return 0


def _kappa(a: np.ndarray, b: np.ndarray) -> float:
    po = float((a == b).mean())
    pe = float(a.mean() * b.mean() + (1 - a.mean()) * (1 - b.mean()))
    return (po - pe) / (1 - pe) if pe < 1 else 1.0


def precision_relabelled(
    acc: np.ndarray, y: np.ndarray, agreed: dict[int, int], rng: np.random.Generator
) -> dict[str, Any]:
    """Precision against the annotators' agreed label; ``agreed`` maps test index -> 1/0 (both said 1)."""
    fp_idx = np.flatnonzero(acc & ~y)
    tp_idx = np.flatnonzero(acc & y)
    fp_judged = [agreed[i] for i in fp_idx if i in agreed]
    tp_judged = np.array([agreed[i] for i in tp_idx if i in agreed])
    fp_dup = np.array(fp_judged + [0] * (len(fp_idx) - len(fp_judged)))  # unjudged count as wrong
    n = len(fp_idx) + len(tp_idx)

    def estimate(tp_rate: float, fp_rate: float) -> float:
        return (len(tp_idx) * tp_rate + len(fp_idx) * fp_rate) / max(n, 1)

    boots = [
        estimate(rng.choice(tp_judged, len(tp_judged)).mean(), rng.choice(fp_dup, len(fp_dup)).mean())
        for _ in range(2000)
    ]
    return {
        "accepted": int(n),
        "qqp_precision": round(len(tp_idx) / max(n, 1), 4),
        "qqp_false_positives": int(len(fp_idx)),
        "false_positives_judged": len(fp_judged),
        "false_positives_both_annotators_call_duplicate": int(fp_dup.sum()),
        "true_positives_judged": int(len(tp_judged)),
        "true_positives_both_annotators_call_duplicate_rate": round(float(tp_judged.mean()), 4),
        "precision_against_agreed_relabel": round(estimate(tp_judged.mean(), fp_dup.mean()), 4),
        "ci95": [round(float(np.percentile(boots, q)), 4) for q in (2.5, 97.5)],
    }


def score() -> int:
    key, judges = read_key(), read_judges()
    if len(judges) < 2:
        sys.exit(f"error: need two annotators' files in {RELABEL_DIR} (judge_<name>.csv)")
    _, test, _ = split_qqp(_read_csv("qqp_dev.csv"))
    row = {r["id"]: i for i, r in enumerate(test)}
    names = sorted(judges)
    items = [k for k in key if all(k["item"] in judges[n] for n in names)]
    lab = np.array([int(k["qqp_label"]) for k in items])
    votes = np.array([[judges[n][k["item"]] for n in names] for k in items])
    both = votes.all(axis=1).astype(int)
    res: dict[str, Any] = {
        "annotators": names,
        "items_judged_by_all": len(items),
        "items_in_key": len(key),
        "agreement": round(float((votes[:, 0] == votes[:, 1]).mean()), 4),
        "cohen_kappa": round(_kappa(votes[:, 0], votes[:, 1]), 4),
        "qqp_negatives_called_duplicate_by_both": round(float(both[lab == 0].mean()), 4),
        "qqp_positives_called_duplicate_by_both": round(float(both[lab == 1].mean()), 4),
    }
    agreed = {row[k["qqp_id"]]: int(b) for k, b in zip(items, both, strict=True)}
    y = np.array([r["is_duplicate"] == "1" for r in test])
    rng = np.random.default_rng(0)
    for name, acc in accepted_sets(test).items():
        res[name] = precision_relabelled(acc, y, agreed, rng)
        res[name]["qqp_recall"] = round(float((acc & y).sum() / y.sum()), 4)
    path = RESULTS_DIR / "verifier_relabel.json"
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample", help="write the accepted pairs not judged yet for annotators")
    s.add_argument("--out", type=Path, required=True, help="folder for judge_in.csv (keep it out of git)")
    s.add_argument("--seed", type=int, default=7)
    sub.add_parser("score", help="agreement and precision against the re-annotation")
    args = ap.parse_args(argv)
    return sample(args.out, args.seed) if args.cmd == "sample" else score()


if __name__ == "__main__":
    raise SystemExit(main())
