"""Training the verifier's classifier: labelled pairs read and checked, features from the embeddings of
an encoder the caller gives, a small MLP ensemble fitted with torch, and the artifact that
``policies.verifier.Verifier`` serves. Kept apart from the serving module: serving loads none of it.
The command (``cachegw train-verifier``) is ``gateway/offline/train_verifier.py``."""

from __future__ import annotations

import csv
import hashlib
import logging
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cachegw.policies.pair_guards import guard_reason
from cachegw.policies.verifier import DEFAULT_RULE, Verifier, VerifierDataError
from cachegw.policies.verifier_features import LEXICAL_NAMES, pair_features

log = logging.getLogger(__name__)


class Encodes(Protocol):
    """What training needs of an encoder: unit vectors for texts."""

    def encode(self, texts: list[str], show_progress: bool = ...) -> np.ndarray: ...


REQUIRED_COLUMNS = ("question1", "question2", "is_duplicate")
_LABELS = {"0": 0, "1": 1, "false": 0, "true": 1, "no": 0, "yes": 1}


def read_pairs(pairs_csv: str | Path) -> tuple[list[str], list[str], np.ndarray]:
    """Read (question1, question2, is_duplicate) rows; raise VerifierDataError with a readable reason."""
    p = Path(pairs_csv)
    if not p.is_file():
        raise VerifierDataError(f"{p}: no such file")
    q1: list[str] = []
    q2: list[str] = []
    labels: list[int] = []
    try:
        with open(p, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            cols = [c.strip() for c in reader.fieldnames or []]
            if not cols:
                want = ", ".join(REQUIRED_COLUMNS)
                raise VerifierDataError(f"{p}: empty file; expected a header with {want}")
            missing = [c for c in REQUIRED_COLUMNS if c not in cols]
            if missing:
                found = ", ".join(cols)
                raise VerifierDataError(f"{p}: missing column(s) {', '.join(missing)}; found {found}")
            reader.fieldnames = cols
            for line, row in enumerate(reader, start=2):
                label = _LABELS.get(str(row["is_duplicate"] or "").strip().lower())
                if label is None:
                    bad = row["is_duplicate"]
                    raise VerifierDataError(f"{p}:{line}: is_duplicate must be 0 or 1, got {bad!r}")
                q1.append(row["question1"] or "")
                q2.append(row["question2"] or "")
                labels.append(label)
    except (UnicodeDecodeError, csv.Error) as e:
        raise VerifierDataError(f"{p}: not a readable UTF-8 CSV ({e})") from None
    if not labels:
        raise VerifierDataError(f"{p}: no pairs after the header")
    if len(set(labels)) < 2:
        raise VerifierDataError(f"{p}: needs both duplicate (1) and non-duplicate (0) pairs")
    return q1, q2, np.asarray(labels, dtype=np.float32)


def _val_mask(q1: list[str], q2: list[str], fraction: float) -> np.ndarray:
    """Deterministic validation split by hashing the pair text (order-independent)."""
    keys = ["\x00".join(sorted((a, b))).encode() for a, b in zip(q1, q2, strict=True)]
    buckets = [int.from_bytes(hashlib.sha1(k).digest()[:4], "big") % 1000 for k in keys]
    return np.array(buckets) < fraction * 1000


def _auc(y: np.ndarray, s: np.ndarray) -> float:
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s))
    ranks[order] = np.arange(1, len(s) + 1)
    pos = y > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / max(n_pos * n_neg, 1))


def _fit_mlp(
    x: np.ndarray, y: np.ndarray, val: np.ndarray, hidden: int, epochs: int, seed: int
) -> dict[str, np.ndarray]:
    """Train the 2-layer MLP with torch (early stopping on validation log loss when there is one)."""
    import torch

    torch.manual_seed(seed)
    tr = ~val if val.any() else np.ones(len(y), dtype=bool)
    mean = x[tr].mean(0)
    std = x[tr].std(0)
    std[std < 1e-6] = 1.0
    xt = torch.from_numpy((x - mean) / std)
    yt = torch.from_numpy(y)
    net = torch.nn.Sequential(
        torch.nn.Dropout(0.1), torch.nn.Linear(x.shape[1], hidden), torch.nn.ReLU(), torch.nn.Dropout(0.3),
        torch.nn.Linear(hidden, 1),
    )  # fmt: skip
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    tr_idx = torch.from_numpy(np.flatnonzero(tr))
    va_idx = torch.from_numpy(np.flatnonzero(val))
    best, best_state, stale = float("inf"), None, 0
    for _ in range(epochs):
        net.train()
        for batch in tr_idx[torch.randperm(len(tr_idx))].split(256):
            opt.zero_grad()
            loss_fn(net(xt[batch]).squeeze(1), yt[batch]).backward()
            opt.step()
        if len(va_idx) == 0:
            continue
        net.eval()
        with torch.no_grad():
            vloss = float(loss_fn(net(xt[va_idx]).squeeze(1), yt[va_idx]))
        stale = 0 if vloss < best - 1e-4 else stale + 1
        if stale == 0:
            best, best_state = vloss, {k: t.clone() for k, t in net.state_dict().items()}
        elif stale >= 4:
            break
    if best_state is not None:
        net.load_state_dict(best_state)
    w = {k: t.detach().numpy() for k, t in net.state_dict().items()}
    return {"mean": mean, "std": std, "w1": w["1.weight"].T.copy(), "b1": w["1.bias"],
            "w2": w["4.weight"].T.copy(), "b2": w["4.bias"]}  # fmt: skip


def _fit_ensemble(
    x: np.ndarray, y: np.ndarray, val: np.ndarray, hidden: int, epochs: int, seed: int, members: int
) -> dict[str, np.ndarray]:
    """Average the logits of several seeds; stored as one wider MLP, so inference is unchanged."""
    fits = []
    for k in range(members):
        log.info(
            "training MLP %d/%d on %d pairs (%d held for early stopping)", k + 1, members, len(y), val.sum()
        )
        fits.append(_fit_mlp(x, y, val, hidden, epochs, seed + k))
    return {
        "mean": fits[0]["mean"],
        "std": fits[0]["std"],
        "w1": np.hstack([f["w1"] for f in fits]),
        "b1": np.concatenate([f["b1"] for f in fits]),
        "w2": np.vstack([f["w2"] for f in fits]) / members,
        "b2": np.mean([f["b2"] for f in fits], axis=0),
    }


def _pr_at(y: np.ndarray, accepted: np.ndarray) -> dict[str, float]:
    tp = float((accepted & (y > 0.5)).sum())
    prec = tp / max(float(accepted.sum()), 1.0)
    rec = tp / max(float((y > 0.5).sum()), 1.0)
    return {"precision": prec, "recall": rec, "f1": 2 * prec * rec / max(prec + rec, 1e-12)}


def read_guarded_pairs(pairs_csv: str | Path) -> tuple[list[str], list[str], np.ndarray, int]:
    """The labelled pairs no hard guard vetoes (those never reach a model when serving), and the count in
    the file; both labels must remain."""
    q1, q2, y = read_pairs(pairs_csv)
    keep = [i for i in range(len(y)) if guard_reason(q1[i], q2[i]) is None]
    if len({int(y[i]) for i in keep}) < 2:
        raise VerifierDataError(f"{pairs_csv}: after the hard guards only one label is left; need both")
    return [q1[i] for i in keep], [q2[i] for i in keep], y[keep], len(y)


def train_verifier(
    pairs_csv: str,
    out_path: str,
    *,
    encoder: Encodes,
    hidden: int = 64,
    members: int = 3,
    epochs: int = 40,
    val_fraction: float = 0.15,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Fit the verifier on labelled pairs and write an artifact loadable with ``Verifier.load``.

    Pairs a hard guard vetoes are dropped first: at serving time they never reach the MLP.
    ``encoder`` embeds the questions (the gateway's MiniLM ``Encoder`` for the served artifact).
    """
    q1, q2, y_kept, n_file = read_guarded_pairs(pairs_csv)
    texts = sorted(set(q1) | set(q2))
    log.info("embedding %d distinct questions from %d pairs", len(texts), len(q1))
    emb = encoder.encode(texts, show_progress=progress)
    row = {t: i for i, t in enumerate(texts)}
    # Identical pairs are certain duplicates that QQP never shows; a few hundred anchor that corner.
    rng = np.random.default_rng(seed)
    n_ident = min(len(texts), max(n_file // 20, 2))
    ident = [texts[i] for i in rng.choice(len(texts), size=n_ident, replace=False)]
    a, b = q1 + ident, q2 + ident
    y_all = np.concatenate([y_kept, np.ones(len(ident), dtype=np.float32)])
    x = pair_features(a, b, emb[[row[t] for t in a]], emb[[row[t] for t in b]])
    val = _val_mask(a, b, val_fraction) if len(a) >= 500 else np.zeros(len(a), dtype=bool)
    val[len(q1) :] = False  # identity pairs only ever train
    params = _fit_ensemble(x, y_all, val, hidden, epochs, seed, members)
    metrics: dict[str, Any] = {
        "pairs_in_file": n_file,
        "pairs_vetoed_by_guards": n_file - len(q1),
        "pairs_trained": int((~val).sum()),
        "pairs_validation": int(val.sum()),
        "identity_pairs_added": len(ident),
    }
    ver = Verifier(params, {"features": list(LEXICAL_NAMES) + ["abs_diff[384]", "product[384]"]})
    if val.any():
        probs = ver._mlp(x[val])
        metrics["val_auc"] = _auc(y_all[val], probs)
        accepted = (x[val, 0] >= DEFAULT_RULE.min_cosine) & (probs >= DEFAULT_RULE.min_prob)
        metrics["val_default_rule"] = _pr_at(y_all[val], accepted)
        gate = x[val, 0] >= DEFAULT_RULE.min_cosine
        metrics["val_curve_at_default_cosine"] = [
            {"min_prob": round(t, 2), **_pr_at(y_all[val], gate & (probs >= t))}
            for t in np.arange(0.5, 0.991, 0.01)
        ]
    ver.meta.update(
        {"trained_on": Path(pairs_csv).name, "metrics": metrics, "hidden": hidden, "members": members}
    )
    ver.save(out_path)
    metrics["artifact"] = str(out_path)
    metrics["artifact_bytes"] = Path(out_path).stat().st_size
    return metrics
