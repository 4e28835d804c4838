"""The verifier's training pairs with intents added, and the calibration sets its rule is chosen on.

    .venv/bin/python -m bench.recall_pairs --out /tmp/recall_pairs.csv \
        --train policies/artifacts/verifier_intents.npz

``--train`` fits the MLP on them as ``cachegw train-verifier`` does (``train_verifier``: guard-vetoed
pairs dropped, 5% identity pairs, three seeds, early stopping on a hashed 15% slice), with the gateway's
own ONNX encoder embedding the texts.

The shipped verifier learned QQP's notion of "the same question" only, which is stricter about wording
than a support desk's intents: on banking77's calibration half it refused 2,000 of 4,508 same-intent
nearest neighbours at cosine >= 0.88 (bench/recall_funnel.py). The pairs here are the shipped ones
(QQP's training split, ``split_qqp``: no question shared with QQP's test split) plus pairs of banking77
texts from the *fit* part of the calibration half (``prior_split.banking_parts``, then a third hash:
``fit`` if ``int(sha1('fit:'+text), 16) % 2 == 0``): each fit text with its nearest fit text of the
same intent (a duplicate) and its nearest fit text of another intent (not one). The *tune* part (the
other half of the calibration half) is where the rule is chosen, with each tune text paired with its
nearest tune text as the semantic tier would pair it; banking77's held-out half is never read here.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import SHARED_DATA, say
from bench.prior_split import Rows, banking_parts, nearest_pairs, read
from bench.verifier_quality import split_qqp


def fit_part(text: str) -> bool:
    return int(hashlib.sha1(f"fit:{text}".encode()).hexdigest(), 16) % 2 == 0


def banking_fit_tune(data: Path = SHARED_DATA) -> tuple[Rows, Rows]:
    """(fit, tune) rows of banking77's calibration half."""
    calib, _ = banking_parts(read(data, "banking77_train.csv"))
    return [r for r in calib if fit_part(r["text"])], [r for r in calib if not fit_part(r["text"])]


def calibration_sets(data: Path = SHARED_DATA) -> tuple[dict[str, Any], dict[str, Any]]:
    """``hit_choice.pair_sets`` with banking77's calibration set narrowed to the tune part (each tune
    text with its nearest tune text), since the fit part trained the MLP: (calibration, held out)."""
    from bench.hit_choice import Pairs, pair_sets

    calib, held = pair_sets()
    _, tune = banking_fit_tune(data)
    calib["banking77"] = Pairs(*nearest_pairs(tune))
    return calib, held


def intent_pairs(rows: Rows) -> list[tuple[str, str, int]]:
    """Each text with its nearest same-intent text (1) and its nearest other-intent text (0)."""
    from cachegw.gateway.offline.calibrate import gateway_encoder

    texts = [r["text"] for r in rows]
    intent = np.array([r["category"] for r in rows])
    emb = gateway_encoder("auto").encode(texts)
    sims = emb @ emb.T
    np.fill_diagonal(sims, -2.0)
    out: set[tuple[str, str, int]] = set()
    for i in range(len(texts)):
        same = intent == intent[i]
        for label, mask in ((1, same), (0, ~same)):
            cand = np.where(mask, sims[i], -3.0)
            j = int(cand.argmax())
            if cand[j] > -2.0:
                a, b = sorted((texts[i], texts[j]))
                out.add((a, b, label))
    return sorted(out)


def qqp_replay(rows: Rows, n: int) -> Rows:
    """``n`` QQP training pairs, chosen by hash: replayed beside the intents so that fine-tuning the
    cross-encoder on intents does not make it forget QQP's notion."""
    key = [int(hashlib.sha1(f"replay:{r['id']}".encode()).hexdigest(), 16) for r in rows]
    return [rows[i] for i in np.argsort(key)[:n]]


def train_cross(pairs: list[tuple[str, str, int]], qqp: Rows, out: Path, epochs: float, lr: float) -> None:
    """The shipped cross-encoder fine-tuned on the intent pairs plus as many QQP training pairs, under
    the guard filter as ``train-verifier --cross`` applies it."""
    from cachegw.embeddings.cross_encoder import ARTIFACT_PATH, CrossConfig, train_cross_encoder
    from cachegw.policies.pair_guards import guard_reason

    replay = [(r["question1"], r["question2"], int(r["is_duplicate"])) for r in qqp_replay(qqp, len(pairs))]
    rows = [*pairs, *replay]
    rows = [r for r in rows if guard_reason(r[0], r[1]) is None]
    y = np.array([r[2] for r in rows], dtype=np.float32)
    cfg = CrossConfig(epochs=epochs, lr=lr)
    a, b = [r[0] for r in rows], [r[1] for r in rows]
    meta = train_cross_encoder(a, b, y, out, cfg, say, init=ARTIFACT_PATH)
    say(f"wrote {out}: {meta}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=SHARED_DATA)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--train", type=Path, default=None, help="fit the MLP on the pairs into this artifact")
    ap.add_argument("--cross", type=Path, default=None, help="fine-tune the cross-encoder into this artifact")
    ap.add_argument("--cross-epochs", type=float, default=1.0)
    ap.add_argument("--cross-lr", type=float, default=2e-4)
    args = ap.parse_args()
    train, _, _ = split_qqp(read(args.data, "qqp_dev.csv"))
    fit, _ = banking_fit_tune(args.data)
    bank = intent_pairs(fit)
    with open(args.out, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["question1", "question2", "is_duplicate"])
        w.writerows((r["question1"], r["question2"], r["is_duplicate"]) for r in train)
        w.writerows(bank)
    pos = sum(label for *_, label in bank)
    say(f"wrote {args.out}: {len(train)} QQP pairs, {len(bank)} banking77 pairs ({pos} same intent)")
    if args.cross is not None:  # CPU-heavy: run it under the bench lock
        train_cross(bank, train, args.cross, args.cross_epochs, args.cross_lr)
    if args.train is not None:
        from cachegw.embeddings.onnx_encoder import OnnxEncoder
        from cachegw.policies.verifier_training import train_verifier

        metrics = train_verifier(str(args.out), str(args.train), encoder=OnnxEncoder().load())
        say(f"wrote {args.train}: {metrics['pairs_trained']} pairs trained, val AUC {metrics.get('val_auc')}")


if __name__ == "__main__":
    main()
