"""Held-out quality of the semantic-cache verifier vs. cosine thresholds alone.

Usage (from the project root):
    HF_HUB_OFFLINE=1 .venv/bin/python bench/verifier_quality.py [--retrain] [--retrain-cross]

Reads ../shared/data/qqp_dev.csv and banking77_train.csv (never copied into the project). QQP is split
deterministically by hashing the pair id (30% test); training pairs that share any question text with a
test pair are dropped, so no test question is ever seen in training. ``--retrain`` refits the shipped
artifact on the training side of that split; ``--retrain-cross`` refits the cross-encoder stage too (about
20 minutes on 2 cores). The default verifier is scored as the gateway loads it (``load_verifier`` with the
shipped config: MLP plus the int8 ONNX cross-encoder), and the MLP alone next to it. banking77 is scored
without retraining.
Writes bench/results/verifier_quality.json and verifier_quality.png, prints a table.
Before / after the alignment of two queries (policies/pair_diff.py), per family of request shapes and on
the same QQP and banking77 sets: bench/verifier_families.py.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import RESULTS as RESULTS_DIR  # noqa: E402
from bench.common import SHARED_DATA as DATA_DIR  # noqa: E402
from bench.common import machine  # noqa: E402
from cachegw.embeddings.encoder import Encoder  # noqa: E402
from cachegw.gateway.cache.verifier_loader import load_verifier  # noqa: E402
from cachegw.gateway.config import load_settings  # noqa: E402
from cachegw.policies.pair_guards import guard_reason  # noqa: E402
from cachegw.policies.verifier import ARTIFACT_PATH, DEFAULT_RULE, Verifier  # noqa: E402
from cachegw.policies.verifier_training import train_verifier  # noqa: E402

TEST_PERCENT = 30
BASELINE_COSINES = (0.80, 0.90, 0.95)  # GPTCache / RedisVL / Portkey-style fixed thresholds
CACHE_DIR = Path(tempfile.gettempdir()) / "cachegw-bench-embeddings"


class CachedEncoder:
    """Encoder memoised per text in one store under the temp dir, so reruns skip the 10-minute embed."""

    def __init__(self, cache_dir: Path = CACHE_DIR) -> None:
        self._enc = Encoder()
        self._dir = cache_dir
        cache_dir.mkdir(parents=True, exist_ok=True)
        self._texts_path, self._emb_path = cache_dir / "texts.json", cache_dir / "emb.npy"
        self._texts: list[str] = []
        self._emb = np.zeros((0, self._enc.dim), dtype=np.float32)
        if self._texts_path.exists() and self._emb_path.exists():
            self._texts = json.loads(self._texts_path.read_text())
            self._emb = np.load(self._emb_path)
        self._row = {t: i for i, t in enumerate(self._texts[: len(self._emb)])}

    def encode(self, texts: list[str], show_progress: bool = True) -> np.ndarray:
        missing = list(dict.fromkeys(t for t in texts if t not in self._row))
        if missing:
            print(f"  embedding {len(missing):,} new texts (cached in {self._dir})", flush=True)
            new = self._enc.encode(missing, show_progress=show_progress)
            self._row.update({t: len(self._texts) + i for i, t in enumerate(missing)})
            self._texts += missing
            self._emb = np.vstack([self._emb, new])
            self._texts_path.write_text(json.dumps(self._texts))
            np.save(self._emb_path, self._emb)
        return self._emb[[self._row[t] for t in texts]]


def _read_csv(name: str) -> list[dict[str, str]]:
    path = DATA_DIR / name
    if not path.is_file():
        sys.exit(f"error: {path} not found; this benchmark reads evaluation data from ../shared/data")
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _norm_text(t: str) -> str:
    return " ".join(t.lower().split())


def split_qqp(
    rows: list[dict[str, str]],
) -> tuple[list[dict[str, str]], list[dict[str, str]], dict[str, Any]]:
    """30% test by sha1(id); train keeps only pairs whose two questions never occur in the test split."""
    is_test = [
        int(hashlib.sha1(f"qqp:{r['id']}".encode()).hexdigest(), 16) % 100 < TEST_PERCENT for r in rows
    ]
    test = [r for r, t in zip(rows, is_test, strict=True) if t]
    test_texts = {_norm_text(r[k]) for r in test for k in ("question1", "question2")}
    train_all = [r for r, t in zip(rows, is_test, strict=True) if not t]
    train = [r for r in train_all if _norm_text(r["question1"]) not in test_texts]
    train = [r for r in train if _norm_text(r["question2"]) not in test_texts]
    info = {
        "rule": f"test if int(sha1('qqp:'+id), 16) % 100 < {TEST_PERCENT}",
        "test_pairs": len(test),
        "train_pairs_before_decontamination": len(train_all),
        "train_pairs": len(train),
        "train_pairs_dropped_for_sharing_a_test_question": len(train_all) - len(train),
    }
    return train, test, info


def _embed_pairs(enc: CachedEncoder, q1: list[str], q2: list[str]) -> tuple[np.ndarray, np.ndarray]:
    texts = sorted(set(q1) | set(q2))
    emb = enc.encode(texts)
    row = {t: i for i, t in enumerate(texts)}
    return emb[[row[t] for t in q1]], emb[[row[t] for t in q2]]


def _prf(y: np.ndarray, acc: np.ndarray) -> dict[str, float]:
    tp = float((acc & y).sum())
    p = tp / max(float(acc.sum()), 1.0)
    r = tp / max(float(y.sum()), 1.0)
    return {"precision": round(p, 4), "recall": round(r, 4), "f1": round(2 * p * r / max(p + r, 1e-12), 4)}


def _curve(
    y: np.ndarray, scores: np.ndarray, thresholds: np.ndarray, gate: np.ndarray
) -> list[dict[str, float]]:
    return [{"threshold": round(float(t), 3), **_prf(y, gate & (scores >= t))} for t in thresholds]


def evaluate(
    verifier: Verifier, q1: list[str], q2: list[str], y: np.ndarray, enc: CachedEncoder
) -> dict[str, Any]:
    """Cosine-alone and cosine+verifier metrics on one labelled pair set."""
    e1, e2 = _embed_pairs(enc, q1, q2)
    cos = np.einsum("ij,ij->i", e1, e2)
    print(f"  scoring {len(q1):,} pairs with the verifier", flush=True)
    prob = np.concatenate(
        [
            verifier.score_batch(q1[i : i + 2048], q2[i : i + 2048], e1[i : i + 2048], e2[i : i + 2048])
            for i in range(0, len(q1), 2048)
        ]
    )
    ones = np.ones(len(y), dtype=bool)
    vetoed = np.array([guard_reason(a, b) is not None for a, b in zip(q1, q2, strict=True)])
    default_acc = np.array([DEFAULT_RULE.decide(float(c), float(p)) for c, p in zip(cos, prob, strict=True)])
    default = _prf(y, default_acc)
    # Cosine alone at the recall the default setting reaches: the like-for-like precision comparison.
    cos_sorted = np.sort(cos[y])[::-1]
    k = max(int(round(default["recall"] * y.sum())) - 1, 0)
    cos_at_same_recall = _prf(y, cos >= cos_sorted[min(k, len(cos_sorted) - 1)])
    baselines = [
        {
            "cosine_threshold": t,
            "cosine_alone": _prf(y, cos >= t),
            "cosine_plus_verifier": _prf(y, (cos >= t) & (prob >= DEFAULT_RULE.min_prob)),
        }
        for t in BASELINE_COSINES
    ]
    return {
        "pairs": len(y),
        "positives": int(y.sum()),
        "default_rule": {"min_cosine": DEFAULT_RULE.min_cosine, "min_prob": DEFAULT_RULE.min_prob, **default},
        "cosine_alone_at_default_recall": cos_at_same_recall,
        "baselines": baselines,
        "curve_cosine_alone": _curve(y, cos, np.arange(0.50, 1.0001, 0.01), ones),
        "curve_verifier_at_default_cosine": _curve(
            y, prob, np.arange(0.0, 1.0001, 0.02), cos >= DEFAULT_RULE.min_cosine
        ),
        "max_precision_cosine_alone_recall_ge_0.3": max(
            (
                c["precision"]
                for c in _curve(y, cos, np.arange(0.5, 1.0001, 0.005), ones)
                if c["recall"] >= 0.3
            ),
            default=0.0,
        ),
        "vetoed_by_guards": {
            "pairs": int(vetoed.sum()),
            "duplicates_among_them": int(y[vetoed].sum()),
        },
    }


def banking77_pairs(enc: CachedEncoder) -> dict[str, tuple[list[str], list[str], np.ndarray]]:
    """Two pair sets from banking77 (label = same intent), built from MiniLM nearest neighbours.

    ``nn_lookup``: each query with its nearest other query (what a cache lookup would retrieve).
    ``hard_balanced``: each query with its nearest same-intent and nearest other-intent query.
    Exact-duplicate texts are collapsed first; unordered pairs are deduplicated.
    """
    seen: dict[str, dict[str, str]] = {}
    for r in _read_csv("banking77_train.csv"):
        seen.setdefault(_norm_text(r["text"]), r)
    texts = [r["text"] for r in seen.values()]
    cats = np.array([r["category"] for r in seen.values()])
    emb = enc.encode(texts)
    sets: dict[str, set[tuple[int, int]]] = {"nn_lookup": set(), "hard_balanced": set()}
    for start in range(0, len(texts), 1024):
        sims = emb[start : start + 1024] @ emb.T
        idx = np.arange(start, min(start + 1024, len(texts)))
        sims[idx - start, idx] = -2.0
        same = cats[idx][:, None] == cats[None, :]
        for r, i in enumerate(idx):
            j_any = int(np.argmax(sims[r]))
            j_same = int(np.argmax(np.where(same[r], sims[r], -2.0)))
            j_diff = int(np.argmax(np.where(same[r], -2.0, sims[r])))
            sets["nn_lookup"].add((min(i, j_any), max(i, j_any)))
            sets["hard_balanced"].update({(min(i, j_same), max(i, j_same)), (min(i, j_diff), max(i, j_diff))})
    out = {}
    for name, pairs in sets.items():
        ordered = sorted(pairs)
        y = np.array([cats[i] == cats[j] for i, j in ordered])
        out[name] = ([texts[i] for i, _ in ordered], [texts[j] for _, j in ordered], y)
    return out


def latency(
    verifier: Verifier, q1: list[str], q2: list[str], e1: np.ndarray, e2: np.ndarray
) -> dict[str, float]:
    """Per-pair verifier time: one pair per call (gateway path) and a batch of 256."""
    n = min(500, len(q1))
    t = []
    for i in range(n):
        t0 = time.perf_counter()
        verifier.score(q1[i], q2[i], e1[i], e2[i])
        t.append(time.perf_counter() - t0)
    # lexical parsing is cached per text; fresh strings measure the cold path
    cold = []
    for i in range(n):
        a, b = q1[i] + " ", q2[i] + " "
        t0 = time.perf_counter()
        verifier.score(a, b, e1[i], e2[i])
        cold.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    verifier.score_batch([s + "  " for s in q1[:256]], [s + "  " for s in q2[:256]], e1[:256], e2[:256])
    batch = (time.perf_counter() - t0) / min(256, len(q1))
    return {
        "single_pair_median_ms_cached_parse": round(float(np.median(t)) * 1e3, 3),
        "single_pair_median_ms_cold": round(float(np.median(cold)) * 1e3, 3),
        "single_pair_p99_ms_cold": round(float(np.percentile(cold, 99)) * 1e3, 3),
        "batch256_per_pair_ms_cold": round(batch * 1e3, 3),
    }


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["qqp_test", "banking77_nn_lookup", "banking77_hard_balanced"]
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 5))
    for ax, name in zip(axes, names, strict=True):
        r = results[name]
        mlp = results.get(f"{name}_mlp_only", {}).get("curve_verifier_at_default_cosine", [])
        floor = DEFAULT_RULE.min_cosine
        for pts_src, label in (
            (r["curve_cosine_alone"], "cosine alone"),
            (mlp, f"cosine>={floor} + MLP only (sweep prob)"),
            (r["curve_verifier_at_default_cosine"], f"cosine>={floor} + MLP + cross-encoder (sweep prob)"),
        ):
            pts = [(c["recall"], c["precision"]) for c in pts_src if c["recall"] > 0]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label)
        for b in r["baselines"]:
            ca = b["cosine_alone"]
            ax.scatter(ca["recall"], ca["precision"], marker="x", color="gray")
            ax.annotate(f"cos {b['cosine_threshold']:.2f}", (ca["recall"], ca["precision"]), fontsize=8)
        d = r["default_rule"]
        ax.scatter(
            d["recall"], d["precision"], marker="*", s=200, color="red", zorder=5, label="default rule"
        )
        ax.axhline(0.95, ls=":", color="k", lw=0.8)
        ax.set(title=name, xlabel="recall", ylabel="precision", xlim=(0, 1), ylim=(0.3, 1.01))
        ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _retrain(train_rows: list[dict[str, str]], enc: CachedEncoder, cross: bool) -> dict[str, Any]:
    """Refit the shipped artifacts on the train split exactly as ``cachegw train-verifier [--cross]`` does."""
    with tempfile.TemporaryDirectory() as tmp:
        csv_path = Path(tmp) / "qqp_train_split.csv"
        with open(csv_path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(
                f, fieldnames=["question1", "question2", "is_duplicate"], extrasaction="ignore"
            )
            w.writeheader()
            w.writerows(train_rows)
        out = {"mlp": train_verifier(str(csv_path), str(ARTIFACT_PATH), encoder=enc)}
        if cross:
            from cachegw.embeddings.cross_encoder import ARTIFACT_PATH as CROSS_PATH
            from cachegw.gateway.offline.train_verifier import train_cross_from_csv

            out["cross_encoder"] = train_cross_from_csv(csv_path, CROSS_PATH)
        return out


def _row(name: str, m: dict[str, float]) -> str:
    return f"{name:<44} {m['precision']:>9.3f} {m['recall']:>7.3f} {m['f1']:>6.3f}"


def print_table(results: dict[str, Any]) -> None:
    for name in ("qqp_test", "banking77_nn_lookup", "banking77_hard_balanced"):
        r = results[name]
        print(f"\n{name}: {r['pairs']:,} pairs, {r['positives']:,} positive")
        print(f"{'setting':<44} {'precision':>9} {'recall':>7} {'F1':>6}")
        d = r["default_rule"]
        print(_row(f"DEFAULT cos>={d['min_cosine']:.2f} + verifier p>={d['min_prob']:.2f}", d))
        print(_row("  same rule, MLP only (no cross-encoder)", results[f"{name}_mlp_only"]["default_rule"]))
        print(_row("cosine alone at the default's recall", r["cosine_alone_at_default_recall"]))
        for b in r["baselines"]:
            t = b["cosine_threshold"]
            print(_row(f"cosine >= {t:.2f} alone", b["cosine_alone"]))
            print(
                _row(
                    f"cosine >= {t:.2f} + verifier p>={DEFAULT_RULE.min_prob:.2f}", b["cosine_plus_verifier"]
                )
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--retrain", action="store_true", help="refit the shipped MLP artifact on the QQP train split"
    )
    ap.add_argument(
        "--retrain-cross", action="store_true", help="also refit the cross-encoder stage (~20 min on 2 cores)"
    )
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    enc = CachedEncoder()
    print("[1/4] splitting qqp_dev.csv", flush=True)
    train, test, split_info = split_qqp(_read_csv("qqp_dev.csv"))
    print(f"  {json.dumps(split_info)}")
    results: dict[str, Any] = {"machine": machine(), "split": split_info}
    if args.retrain or args.retrain_cross or not ARTIFACT_PATH.exists():
        print(f"[2/4] training the verifier on {len(train):,} pairs -> {ARTIFACT_PATH}", flush=True)
        results["training"] = _retrain(train, enc, args.retrain_cross)
    else:
        print("[2/4] using the shipped artifacts (pass --retrain / --retrain-cross to refit)", flush=True)
    verifier = load_verifier(load_settings(None).cache)  # what the gateway serves with
    mlp_only = Verifier.load()
    results["artifact"] = {
        "path": str(ARTIFACT_PATH.relative_to(ROOT)),
        "bytes": ARTIFACT_PATH.stat().st_size,
    }
    results["artifact"]["trained"] = verifier.meta.get("metrics", {})
    from cachegw.embeddings.cross_encoder import ARTIFACT_PATH as CROSS_PATH

    results["cross_encoder_artifact"] = {
        "path": str(CROSS_PATH.relative_to(ROOT)),
        "bytes": CROSS_PATH.stat().st_size,
        "serving": type(verifier.cross).__name__,  # CrossScorer = int8 ONNX, as the gateway runs it
        "trained": json.loads(str(np.load(CROSS_PATH)["meta"])),
    }
    print("[3/4] evaluating on the held-out QQP split", flush=True)
    q1, q2 = [r["question1"] for r in test], [r["question2"] for r in test]
    y = np.array([r["is_duplicate"] == "1" for r in test])
    results["qqp_test"] = evaluate(verifier, q1, q2, y, enc)
    results["qqp_test_mlp_only"] = evaluate(mlp_only, q1, q2, y, enc)
    e1, e2 = _embed_pairs(enc, q1, q2)
    results["latency"] = latency(verifier, q1, q2, e1, e2)
    results["latency_mlp_only"] = latency(mlp_only, q1, q2, e1, e2)
    print("[4/4] banking77 (no retraining)", flush=True)
    for name, (b1, b2, by) in banking77_pairs(enc).items():
        results[f"banking77_{name}"] = evaluate(verifier, b1, b2, by, enc)
        results[f"banking77_{name}_mlp_only"] = evaluate(mlp_only, b1, b2, by, enc)
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "verifier_quality.json").write_text(json.dumps(results, indent=1))
    plot(results, RESULTS_DIR / "verifier_quality.png")
    print_table(results)
    print(f"\nlatency: {json.dumps(results['latency'])}")
    print(f"wrote {RESULTS_DIR / 'verifier_quality.json'} and verifier_quality.png in {results['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
