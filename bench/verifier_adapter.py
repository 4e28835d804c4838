"""Experiment: does a light adapter on the frozen MiniLM sentence embedding lift the verifier on QQP?

Usage (from the project root, one CPU thread so it can share the box):
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python -m bench.verifier_adapter [--repeats 5]

Report-only: the shipped verifier is not touched. The issue allows "a light adapter on the embedding", so
this script learns, from the TRAIN side of ``bench.verifier_quality.split_qqp`` only, either

* ``linear``: a full map W (384x384, initialised to the identity) scored by cos(Wu, Wv), or
* ``lowrank-r``: a symmetric low-rank bilinear score u.v + (uP.vQ + uQ.vP) / 2 with P, Q of rank r,

with a logistic loss on sigmoid(a * score + b) for duplicate vs non-duplicate pairs (a, b learnt too) plus
an L2 pull of the adapter towards the identity. The adapter holds out the same hashed 15% validation slice
that the verifier uses and early-stops on its log loss there, so the slice stays out-of-sample for the
adapter, for the MLP's own early stopping and for the operating-point choice. The adapted score then feeds
the same MLP: ``+ adapted cos`` appends one column to the shipped ``pair_features``; ``adapted features``
(linear only) computes ``pair_features`` on the adapted vectors (adapted cosine, |Wu-Wv|, Wu*Wv) and
appends the raw cosine. The gate stays the raw cosine >= 0.88 (what FAISS searches today).

Training, operating point (chosen on validation), 5-seed reporting and the ORACLE (best test precision at
test recall >= 0.30) come from ``bench.verifier_token_alignment``. The adapted score is also reported
ALONE as a classifier on every pair (no MLP, no gate): AUC and best precision at recall >= 0.30, on
train/val/test, because if it beat the raw cosine the gateway could search FAISS in the adapted space.

Embeddings are the cached ones of ``bench.verifier_quality.CachedEncoder`` (never re-embedded).
Writes bench/results/verifier_adapter.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import RESULTS as RESULTS_DIR  # noqa: E402
from bench.common import machine  # noqa: E402
from bench.verifier_eval import (  # noqa: E402
    TARGET_RECALL,
    PairSet,
    auc,
    operating_points,
    oracle,
    qqp_pair_sets,
    subset,
)
from bench.verifier_quality import CACHE_DIR as EMB_DIR  # noqa: E402
from bench.verifier_token_alignment import print_table, train  # noqa: E402
from cachegw.policies.verifier import DEFAULT_RULE, Verifier  # noqa: E402
from cachegw.policies.verifier_training import _val_mask  # noqa: E402

VAL_FRACTION = 0.15  # the verifier's validation slice (``train_verifier``)


# ------------------------------------------------------------------------------------------ embeddings


@dataclass
class EmbStore:
    """Unit-norm sentence vectors per text; duck-types the ``pooled``/``index`` part of ``TokenStore``."""

    texts: list[str]
    pooled: np.ndarray
    index: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.index = {t: i for i, t in enumerate(self.texts)}

    def rows(self, texts: list[str]) -> np.ndarray:
        return self.pooled[[self.index[t] for t in texts]]


def load_cached_embeddings(texts: list[str]) -> EmbStore:
    """Rows of ``CachedEncoder``'s store for ``texts``; exits if any text was never embedded."""
    cached = json.loads((EMB_DIR / "texts.json").read_text())
    emb = np.load(EMB_DIR / "emb.npy", mmap_mode="r")
    row = {t: i for i, t in enumerate(cached[: len(emb)])}
    missing = [t for t in texts if t not in row]
    if missing:
        sys.exit(f"error: {len(missing)} QQP texts are not in {EMB_DIR}; run bench/verifier_quality.py first")
    pooled = np.asarray(emb[[row[t] for t in texts]], dtype=np.float32)
    norms = np.linalg.norm(pooled, axis=1)
    print(f"  {len(texts):,} cached vectors, norm {norms.min():.4f}..{norms.max():.4f}", flush=True)
    return EmbStore(texts, pooled / norms[:, None])


# --------------------------------------------------------------------------------------------- adapters


@dataclass
class Adapter:
    kind: str  # "linear" or "lowrank"
    w: np.ndarray | None = None  # [d, d], linear: z = normalize(W u)
    p: np.ndarray | None = None  # [d, r], lowrank
    q: np.ndarray | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def transform(self, u: np.ndarray) -> np.ndarray:
        assert self.w is not None
        z = u @ self.w.T
        return (z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)).astype(np.float32)

    def score(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        if self.kind == "linear":
            return np.einsum("ij,ij->i", self.transform(u), self.transform(v))
        assert self.p is not None and self.q is not None
        cross = np.einsum("ij,ij->i", u @ self.p, v @ self.q) + np.einsum("ij,ij->i", u @ self.q, v @ self.p)
        return (np.einsum("ij,ij->i", u, v) + 0.5 * cross).astype(np.float32)

    @property
    def nbytes_fp32(self) -> int:
        return sum(int(a.size) * 4 for a in (self.w, self.p, self.q) if a is not None)


def fit_adapter(
    kind: str, u: np.ndarray, v: np.ndarray, y: np.ndarray, val: np.ndarray, *, rank: int, l2: float,
    lr: float, seed: int, epochs: int = 60, patience: int = 5, batch: int = 256,
) -> Adapter:  # fmt: skip
    """Logistic loss on a * score(u, v) + b over the non-validation pairs; early stop on validation loss."""
    import torch

    torch.manual_seed(seed)
    d = u.shape[1]
    ut, vt, yt = torch.from_numpy(u), torch.from_numpy(v), torch.from_numpy(y.astype(np.float32))
    if kind == "linear":
        params = {"w": torch.nn.Parameter(torch.eye(d))}
    else:
        params = {
            "p": torch.nn.Parameter(0.01 * torch.randn(d, rank)),
            "q": torch.nn.Parameter(0.01 * torch.randn(d, rank)),
        }
    ab = torch.nn.Parameter(torch.tensor([10.0, -8.0]))  # a * cos + b; refit below before training

    def score(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if kind == "linear":
            za = torch.nn.functional.normalize(a @ params["w"].T, dim=1)
            zb = torch.nn.functional.normalize(b @ params["w"].T, dim=1)
            return (za * zb).sum(1)
        p, q = params["p"], params["q"]
        return (a * b).sum(1) + 0.5 * (((a @ p) * (b @ q)).sum(1) + ((a @ q) * (b @ p)).sum(1))

    def reg() -> torch.Tensor:
        if kind == "linear":
            return ((params["w"] - torch.eye(d)) ** 2).sum()
        return (params["p"] ** 2).sum() + (params["q"] ** 2).sum()

    bce = torch.nn.BCEWithLogitsLoss()
    tr_idx, va_idx = torch.from_numpy(np.flatnonzero(~val)), torch.from_numpy(np.flatnonzero(val))
    # warm-start the logistic calibration (a, b) on the raw cosine, so epoch 0 is the identity adapter
    opt_ab = torch.optim.LBFGS([ab], max_iter=100)
    with torch.no_grad():
        s0 = score(ut[tr_idx], vt[tr_idx])

    def closure() -> torch.Tensor:
        opt_ab.zero_grad()
        loss = bce(ab[0] * s0 + ab[1], yt[tr_idx])
        loss.backward()
        return loss

    opt_ab.step(closure)
    opt = torch.optim.Adam([*params.values(), ab], lr=lr)

    def val_loss() -> float:
        with torch.no_grad():
            return float(bce(ab[0] * score(ut[va_idx], vt[va_idx]) + ab[1], yt[va_idx]))

    best = val_loss()
    hist = [round(best, 5)]
    best_state, best_epoch, stale = {k: t.detach().clone() for k, t in params.items()}, 0, 0
    t0 = time.perf_counter()
    for ep in range(1, epochs + 1):
        for bi in tr_idx[torch.randperm(len(tr_idx))].split(batch):
            opt.zero_grad()
            loss = bce(ab[0] * score(ut[bi], vt[bi]) + ab[1], yt[bi]) + l2 * reg()
            loss.backward()
            opt.step()
        vl = val_loss()
        hist.append(round(vl, 5))
        if vl < best - 1e-4:
            best, best_epoch, stale = vl, ep, 0
            best_state = {k: t.detach().clone() for k, t in params.items()}
        else:
            stale += 1
            if stale >= patience:
                break
    arrays = {k: t.numpy() for k, t in best_state.items()}
    info = {"best_epoch": best_epoch, "epochs_run": len(hist) - 1, "val_logloss_by_epoch": hist,
            "fit_seconds": round(time.perf_counter() - t0, 1), "l2": l2, "lr": lr}  # fmt: skip
    if kind == "linear":
        info["w_minus_identity_fro"] = round(float(np.linalg.norm(arrays["w"] - np.eye(d))), 4)
    return Adapter(kind, **arrays, info=info)


class AdaptedCos:
    """Extra MLP column(s): the adapter score of the pair (and optionally the raw cosine)."""

    def __init__(self, store: EmbStore, adapter: Adapter | None) -> None:
        self.store, self.adapter = store, adapter

    def matrix(self, q1: list[str], q2: list[str]) -> np.ndarray:
        u, v = self.store.rows(q1), self.store.rows(q2)
        s = np.einsum("ij,ij->i", u, v) if self.adapter is None else self.adapter.score(u, v)
        return s[:, None].astype(np.float32)


# ---------------------------------------------------------------------------------------------- metrics


def best_precision_at_recall(y: np.ndarray, s: np.ndarray) -> dict[str, float]:
    """Best precision over all score cuts with recall >= TARGET_RECALL (ties broken by order)."""
    order = np.argsort(-s, kind="stable")
    tp = np.cumsum(y[order])
    k = np.arange(1, len(y) + 1)
    ok = tp / max(int(y.sum()), 1) >= TARGET_RECALL
    i = int(np.argmax(np.where(ok, tp / k, -1.0)))
    return {"precision": round(float(tp[i] / k[i]), 4), "recall": round(float(tp[i] / y.sum()), 4),
            "threshold": round(float(s[order][i]), 5)}  # fmt: skip


def alone(y: np.ndarray, s: np.ndarray, vetoed: np.ndarray) -> dict[str, Any]:
    """The score alone as a classifier on every pair; ``guarded`` sets guard-vetoed pairs to reject."""
    guarded = np.where(vetoed, -np.inf, s)
    return {
        "auc": round(auc(y, s), 4),
        "best_p_at_r_ge_0.3": best_precision_at_recall(y, s),
        "guarded_best_p_at_r_ge_0.3": best_precision_at_recall(y, guarded),
    }


# --------------------------------------------------------------------------------------------- evaluate


@dataclass
class Variant:
    name: str
    store: EmbStore  # vectors ``pair_features`` sees (raw, or the linear adapter's)
    extra: AdaptedCos | None  # extra columns appended to ``pair_features``
    adapter: Adapter | None


def score_pairs(ver: Verifier, raw: EmbStore, var: Variant, ps: PairSet) -> tuple[np.ndarray, np.ndarray]:
    """(raw cosine for the gate, MLP prob, 0 where a guard fires) as in the harness's ``score``."""
    from bench.verifier_token_alignment import features

    cos = np.einsum("ij,ij->i", raw.rows(ps.q1), raw.rows(ps.q2))
    prob = np.zeros(len(ps.y), dtype=np.float32)
    keep = np.flatnonzero(~ps.vetoed)
    x = features(var.store, var.extra, [ps.q1[i] for i in keep], [ps.q2[i] for i in keep])  # type: ignore
    prob[keep] = ver._mlp(x)
    return cos, prob


def evaluate(var: Variant, raw: EmbStore, tr: PairSet, te: PairSet, args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    runs = []
    fit_part = subset(tr, ~_val_mask(tr.q1, tr.q2, VAL_FRACTION))
    n_feat = 0
    for rep in range(args.repeats):
        seed = args.seed + 100 * rep
        print(f"[train] {var.name} (seed {seed})", flush=True)
        ver, val = train(var.store, var.extra, tr, hidden=args.hidden, members=args.members, seed=seed)  # type: ignore
        n_feat = ver.params["w1"].shape[0] if hasattr(ver, "params") else n_feat
        va = subset(tr, val)
        vcos, vprob = score_pairs(ver, raw, var, va)
        tcos, tprob = score_pairs(ver, raw, var, te)
        fcos, fprob = score_pairs(ver, raw, var, fit_part)
        runs.append(
            {
                "seed": seed,
                **operating_points(va, vcos, vprob, te, tcos, tprob),
                "train_oracle_recall_ge_0.3": oracle(fit_part.y, fcos, fprob),
                "train_auc_unvetoed": round(auc(fit_part.y[~fit_part.vetoed], fprob[~fit_part.vetoed]), 4),
            }
        )
        print(f"  {json.dumps(runs[-1])}", flush=True)
    secs = round(time.perf_counter() - t0, 1)
    return {"name": var.name, "runs": runs, "seconds": secs, "n_features": n_feat}


def mlp_bytes(n_features: int, hidden: int, members: int) -> int:
    """fp32 bytes of the ensemble MLP (mean, std, w1, b1, w2, b2) for ``n_features`` inputs."""
    h = hidden * members
    return 4 * (2 * n_features + n_features * h + h + h + 1)


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="MLP seeds per variant (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--ranks", type=int, nargs="*", default=[32, 64])
    ap.add_argument("--l2-linear", type=float, default=1e-4, help="pull of W towards I (per batch loss)")
    ap.add_argument("--l2-lowrank", type=float, default=1e-4)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    print("[1/5] splitting qqp_dev.csv", flush=True)
    tr, te, split_info = qqp_pair_sets()
    print(f"  {json.dumps(split_info)}", flush=True)
    texts = sorted(set(tr.q1) | set(tr.q2) | set(te.q1) | set(te.q2))
    print(f"[2/5] cached sentence embeddings from {EMB_DIR}", flush=True)
    raw = load_cached_embeddings(texts)

    print("[3/5] adapters on the train split (hashed 15% validation held out, early stop)", flush=True)
    val = _val_mask(tr.q1, tr.q2, VAL_FRACTION)
    u_tr, v_tr = raw.rows(tr.q1), raw.rows(tr.q2)
    u_te, v_te = raw.rows(te.q1), raw.rows(te.q2)
    specs = [("linear", 0, args.l2_linear)] + [("lowrank", r, args.l2_lowrank) for r in args.ranks]
    adapters: dict[str, Adapter] = {}
    alone_rows: dict[str, dict[str, Any]] = {}

    def report_alone(label: str, score_fn: Any) -> None:
        s_tr, s_te = score_fn(u_tr, v_tr), score_fn(u_te, v_te)
        alone_rows[label] = {
            "train_fit_part": alone(tr.y[~val], s_tr[~val], tr.vetoed[~val]),
            "val": alone(tr.y[val], s_tr[val], tr.vetoed[val]),
            "test": alone(te.y, s_te, te.vetoed),
        }
        r = alone_rows[label]
        print(f"  {label:<12} alone: AUC train/val/test "
              f"{r['train_fit_part']['auc']:.4f}/{r['val']['auc']:.4f}/{r['test']['auc']:.4f}; "
              f"best P@R>=.3 train/val/test {r['train_fit_part']['best_p_at_r_ge_0.3']['precision']:.3f}/"
              f"{r['val']['best_p_at_r_ge_0.3']['precision']:.3f}/"
              f"{r['test']['best_p_at_r_ge_0.3']['precision']:.3f}", flush=True)  # fmt: skip

    report_alone("raw cosine", lambda a, b: np.einsum("ij,ij->i", a, b))
    for kind, rank, l2 in specs:
        label = "linear" if kind == "linear" else f"lowrank-{rank}"
        print(f"  fitting {label} (l2 {l2}, lr {args.lr})", flush=True)
        ad = fit_adapter(kind, u_tr, v_tr, tr.y, val, rank=rank, l2=l2, lr=args.lr, seed=args.seed)
        hist = ad.info["val_logloss_by_epoch"]
        print(f"    best epoch {ad.info['best_epoch']} of {ad.info['epochs_run']} "
              f"({ad.info['fit_seconds']} s); val loss {hist[:12]}", flush=True)  # fmt: skip
        adapters[label] = ad
        report_alone(label, ad.score)

    print("[4/5] verifier MLP with each adapter", flush=True)
    variants = [Variant("baseline (shipped features)", raw, None, None)]
    for label, ad in adapters.items():
        variants.append(Variant(f"+ {label} adapted cos", raw, AdaptedCos(raw, ad), ad))
        if ad.kind == "linear":
            adapted = EmbStore(texts, ad.transform(raw.pooled))
            variants.append(Variant("linear adapted features", adapted, AdaptedCos(raw, None), ad))
    results = [evaluate(v, raw, tr, te, args) for v in variants]
    for r, v in zip(results, variants, strict=True):
        r["adapter"] = None if v.adapter is None else {"kind": v.adapter.kind, **v.adapter.info}
        r["adapter_bytes_fp32"] = 0 if v.adapter is None else v.adapter.nbytes_fp32
        r["mlp_bytes_fp32"] = mlp_bytes(r["n_features"], args.hidden, args.members)

    print("[5/5] summary", flush=True)
    out = {
        "machine": machine(),
        "split": split_info,
        "protocol": {
            "cosine_floor_gate": f"raw cosine >= {DEFAULT_RULE.min_cosine} (FAISS space unchanged)",
            "adapter_training": "train split only, hashed 15% validation slice held out; logistic loss on "
            "a*score+b, L2 towards identity, Adam, early stopping on validation log loss (patience 5)",
            "operating_point": "min_prob with the best validation precision at validation recall >= 0.30",
            "oracle": "best test precision over min_prob cuts at test recall >= 0.30 (not a claim)",
            "alone": "adapter score alone on every pair (no MLP/gate); guarded = guard-vetoed pairs rejected",
            "auc": "test pairs that pass the guards, MLP probability",
            "hidden": args.hidden,
            "members": args.members,
            "repeats": args.repeats,
            "lr": args.lr,
        },
        "score_alone": alone_rows,
        "models": results,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / "verifier_adapter.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print_table(results)
    print("\ntrain (fit part) vs test, ORACLE P @R>=.3 and AUC (mean over seeds); artifact bytes fp32:")
    for r in results:
        m = {k: np.mean([run[k]["precision"] for run in r["runs"]])
             for k in ("train_oracle_recall_ge_0.3", "test_oracle_recall_ge_0.3")}  # fmt: skip
        a_tr = np.mean([run["train_auc_unvetoed"] for run in r["runs"]])
        a_te = np.mean([run["test_auc_unvetoed"] for run in r["runs"]])
        print(f"  {r['name']:<34} P train {m['train_oracle_recall_ge_0.3']:.3f} test "
              f"{m['test_oracle_recall_ge_0.3']:.3f}  AUC train {a_tr:.4f} test {a_te:.4f}  "
              f"adapter {r['adapter_bytes_fp32']:,} B  mlp {r['mlp_bytes_fp32']:,} B")  # fmt: skip
    print("\nscore ALONE (every pair, no MLP): best precision at recall >= 0.30 / AUC")
    for label, r in alone_rows.items():
        cells = [f"{part} P {r[part]['best_p_at_r_ge_0.3']['precision']:.3f} AUC {r[part]['auc']:.4f}"
                 for part in ("train_fit_part", "val", "test")]  # fmt: skip
        g = r["test"]["guarded_best_p_at_r_ge_0.3"]["precision"]
        print(f"  {label:<12} " + "  ".join(cells) + f"  test+guards P {g:.3f}")
    print(f"wrote {path} in {out['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
