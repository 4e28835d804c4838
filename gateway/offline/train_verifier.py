"""``cachegw train-verifier``: the verifier's artifacts trained from a CSV of labelled pairs.

The command around the pure training code (``policies/verifier_training.py``, given the gateway's
encoder) and the cross-encoder's (``embeddings/cross_encoder.py``, given the same pairs, guard filter and
validation slice).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

from cachegw.embeddings.cross_encoder import CrossConfig, CrossEncoder, train_cross_encoder
from cachegw.embeddings.encoder import Encoder
from cachegw.policies.verifier import VerifierDataError
from cachegw.policies.verifier_training import _auc, _val_mask, read_guarded_pairs, train_verifier

log = logging.getLogger(__name__)


def train_cross_from_csv(
    pairs_csv: str | Path, out: Path | str, cfg: CrossConfig | None = None, val_fraction: float = 0.15
) -> dict[str, Any]:
    """``cachegw train-verifier --cross``: the same pairs, guard filter and validation slice as the MLP."""
    q1, q2, y, _ = read_guarded_pairs(pairs_csv)
    val = _val_mask(q1, q2, val_fraction) if len(y) >= 500 else np.zeros(len(y), dtype=bool)
    fit = np.flatnonzero(~val)
    if len({int(v) for v in y[fit]}) < 2:
        raise VerifierDataError(f"{pairs_csv}: the cross-encoder needs both labels among the training pairs")
    log.info("training the cross-encoder on %d pairs (%d held out)", len(fit), int(val.sum()))
    meta = train_cross_encoder(
        [q1[i] for i in fit], [q2[i] for i in fit], y[fit], out, cfg or CrossConfig(), progress=log.info
    )
    if val.any():
        idx = np.flatnonzero(val)
        probs = CrossEncoder(out).score_batch([q1[i] for i in idx], [q2[i] for i in idx])
        meta["val_pairs"], meta["val_auc"] = len(idx), round(_auc(y[idx], probs), 4)
    return meta


def main_train(argv: list[str] | None = None) -> int:
    """CLI body of ``cachegw train-verifier --pairs FILE.csv [--out PATH]``."""
    parser = argparse.ArgumentParser(
        prog="cachegw train-verifier",
        description="Train the semantic-cache verifier on labelled question pairs "
        "(CSV columns: question1, question2, is_duplicate).",
    )
    parser.add_argument("--pairs", required=True, help="CSV of labelled pairs")
    parser.add_argument("--out", default="verifier.npz", help="artifact to write (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=64, help="MLP hidden units (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=40, help="max epochs (default: %(default)s)")
    parser.add_argument(
        "--cross",
        action="store_true",
        help="also train the cross-encoder stage (LoRA on MiniLM; about 20 min per 17k pairs on 2 CPU cores)",
    )
    parser.add_argument("--cross-out", default=None, help="its artifact (default: <out>-cross.npz)")
    parser.add_argument(
        "--cross-epochs", type=float, default=None, help="its passes over the pairs (default: 3, as shipped)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cross_epochs is not None and args.cross_epochs <= 0:
        print("error: --cross-epochs must be > 0", file=sys.stderr)
        return 2
    try:
        metrics = train_verifier(
            args.pairs, args.out, encoder=Encoder(), hidden=args.hidden, epochs=args.epochs
        )
        print(json.dumps({k: v for k, v in metrics.items() if k != "val_curve_at_default_cosine"}, indent=2))
        print(f"wrote {args.out}; use it with [cache] verifier_path = {str(args.out)!r}")
        if args.cross:
            out = args.cross_out or str(Path(args.out).with_suffix("")) + "-cross.npz"
            cfg = CrossConfig() if args.cross_epochs is None else CrossConfig(epochs=args.cross_epochs)
            meta = train_cross_from_csv(args.pairs, out, cfg)
            print(json.dumps(meta, indent=2))
            print(f"wrote {out}; use it with [cache] cross_verifier_path = {out!r}")
    except VerifierDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
