"""Before / after the alignment of two queries (policies/pair_diff.py), per family, on QQP and banking77.

Usage (from the project root):
    HF_HUB_OFFLINE=1 .venv/bin/python bench/verifier_families.py [--families-only]

*Before* is the semantic tier as it was: the verifier (guards with numbers as digit strings, MLP,
cross-encoder) on the two whole texts and their whole-text embeddings (the encoder reads the first 256
word pieces). *After* is what the gateway does now (``SemanticTier._refusal``): align the texts, refuse
on differing material, code, opposites or units, and otherwise let the verifier judge the differing
part, embedded alone when it is not the whole text. Both at the default rule (cosine >= 0.88, p >= 0.80),
every pair taken as the candidate the index returned.

Pairs: bench/data/verifier_families.jsonl (bench/make_verifier_families.py; ``tune`` and ``heldout``
splits by material), the held-out QQP test split of bench/verifier_quality.py and its two banking77 sets.
Embeddings are cached as in bench/verifier_quality.py. Writes bench/results/verifier_families.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import RESULTS, machine  # noqa: E402
from bench.verifier_quality import CACHE_DIR, CachedEncoder, _read_csv, banking77_pairs, split_qqp  # noqa: E402
from cachegw.gateway.cache.verifier_loader import load_verifier  # noqa: E402
from cachegw.gateway.config import load_settings  # noqa: E402
from cachegw.policies.pair_diff import align  # noqa: E402
from cachegw.policies.verifier import DEFAULT_RULE, Verifier  # noqa: E402

FAMILIES = ROOT / "bench" / "data" / "verifier_families.jsonl"
CHUNK = 1024


def _embed(enc: CachedEncoder, texts: list[str]) -> np.ndarray:
    uniq = sorted(set(texts))
    emb = enc.encode(uniq, show_progress=False)
    row = {t: i for i, t in enumerate(uniq)}
    return emb[[row[t] for t in texts]]


def before(v: Verifier, q1: list[str], q2: list[str], enc: CachedEncoder) -> tuple[np.ndarray, list[str]]:
    e1, e2 = _embed(enc, q1), _embed(enc, q2)
    verdicts = []
    for i in range(0, len(q1), CHUNK):
        s = slice(i, i + CHUNK)
        verdicts += v.check_batch(q1[s], q2[s], e1[s], e2[s], DEFAULT_RULE)
    return np.array([x.accepted for x in verdicts]), [x.reason for x in verdicts]


def after(
    v: Verifier, q1: list[str], q2: list[str], enc: CachedEncoder
) -> tuple[np.ndarray, list[str], list[float]]:
    t_align = []
    als = []
    for a, b in zip(q1, q2, strict=True):
        t0 = time.perf_counter()
        als.append(align(a, b))
        t_align.append(time.perf_counter() - t0)
    acc = np.zeros(len(q1), dtype=bool)
    reasons = ["hit" if al.outcome == "same" else al.reason for al in als]
    acc[[i for i, al in enumerate(als) if al.outcome == "same"]] = True
    for partial in (False, True):  # the whole texts, or a part of longer messages (no cross-encoder)
        judge = [i for i, al in enumerate(als) if al.outcome == "judge" and al.reembed == partial]
        if not judge:
            continue
        fa, fb = [als[i].focus_new for i in judge], [als[i].focus_old for i in judge]
        e1, e2 = _embed(enc, fa), _embed(enc, fb)
        for k in range(0, len(judge), CHUNK):
            s = slice(k, k + CHUNK)
            verdicts = v.check_batch(fa[s], fb[s], e1[s], e2[s], DEFAULT_RULE, cross=not partial)
            for i, verdict in zip(judge[s], verdicts, strict=True):
                acc[i], reasons[i] = verdict.accepted, verdict.reason
    return acc, reasons, t_align


def _prf(y: np.ndarray, acc: np.ndarray) -> dict[str, Any]:
    tp, fp = int((acc & y).sum()), int((acc & ~y).sum())
    return {
        "precision": round(tp / max(tp + fp, 1), 4) if tp + fp else None,
        "recall": round(tp / max(int(y.sum()), 1), 4) if y.any() else None,
        "true_hits": tp,
        "false_hits": fp,
        "negatives": int((~y).sum()),
        "positives": int(y.sum()),
    }


def _counts(reasons: list[str], mask: np.ndarray) -> dict[str, int]:
    out: dict[str, int] = {}
    for r, m in zip(reasons, mask, strict=True):
        if m:
            out[r] = out.get(r, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def compare(
    name: str, old: Verifier, new: Verifier, q1: list[str], q2: list[str], y: np.ndarray, enc: CachedEncoder
) -> dict[str, Any]:
    print(f"  {name}: {len(y):,} pairs", flush=True)
    acc_b, _ = before(old, q1, q2, enc)
    acc_a, reasons, t_align = after(new, q1, q2, enc)
    return {
        "before": _prf(y, acc_b),
        "after": _prf(y, acc_a),
        "newly_refused": _counts(reasons, acc_b & ~acc_a),
        "newly_refused_positives": int((acc_b & ~acc_a & y).sum()),
        "newly_accepted": int((~acc_b & acc_a).sum()),
        "newly_accepted_negatives": int((~acc_b & acc_a & ~y).sum()),
        "align_us_median": round(float(np.median(t_align)) * 1e6, 1),
        "align_us_p99": round(float(np.percentile(t_align, 99)) * 1e6, 1),
    }


def families(old: Verifier, new: Verifier, enc: CachedEncoder) -> dict[str, Any]:
    rows = [json.loads(line) for line in FAMILIES.open(encoding="utf-8")]
    out: dict[str, Any] = {}
    for fam in sorted({r["family"] for r in rows}):
        for split in ("tune", "heldout"):
            sel = [r for r in rows if r["family"] == fam and r["split"] == split]
            q1, q2 = [r["question1"] for r in sel], [r["question2"] for r in sel]
            y = np.array([r["label"] == 1 for r in sel])
            out[f"{fam}/{split}"] = compare(f"{fam}/{split}", old, new, q1, q2, y, enc)
    return out


def _fmt(m: dict[str, Any]) -> str:
    p = "  -  " if m["precision"] is None else f"{m['precision']:.3f}"
    r = "  -  " if m["recall"] is None else f"{m['recall']:.3f}"
    return f"{p:>6} {r:>6} {m['false_hits']:>4}/{m['negatives']:<5}"


def print_table(results: dict[str, Any]) -> None:
    print(f"\n{'set':<32} {'before: P':>9} {'R':>6} {'FP/neg':>10}   {'after: P':>8} {'R':>6} {'FP/neg':>10}")
    for name, r in results["sets"].items():
        print(f"{name:<32} {_fmt(r['before'])}   {_fmt(r['after'])}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--families-only", action="store_true", help="skip QQP and banking77 (seconds, not minutes)"
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    enc_families = CachedEncoder(CACHE_DIR.with_name(CACHE_DIR.name + "-families"))
    new = load_verifier(load_settings(None).cache)  # what the gateway serves with
    old = Verifier(new.params, new.meta, new.cross)
    old.units = False
    results: dict[str, Any] = {"machine": machine(), "rule": DEFAULT_RULE.__dict__, "sets": {}}
    print("[1/3] families", flush=True)
    results["sets"].update(families(old, new, enc_families))
    if not args.families_only:
        enc = CachedEncoder()
        print("[2/3] QQP held-out test split", flush=True)
        _, test, _ = split_qqp(_read_csv("qqp_dev.csv"))
        q1, q2 = [r["question1"] for r in test], [r["question2"] for r in test]
        y = np.array([r["is_duplicate"] == "1" for r in test])
        results["sets"]["qqp_test"] = compare("qqp_test", old, new, q1, q2, y, enc)
        print("[3/3] banking77", flush=True)
        for name, (b1, b2, by) in banking77_pairs(enc).items():
            results["sets"][f"banking77_{name}"] = compare(f"banking77_{name}", old, new, b1, b2, by, enc)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    print_table(results)
    if args.families_only:  # a partial run: printed, not written over the full results
        print(f"\n{results['seconds']} s")
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "verifier_families.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwrote bench/results/verifier_families.json in {results['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
