"""The shipped false-hit prior's data, and the held-out part the replay measures it on.

Pairs the verifier never trained on (QQP's test split, ``bench/verifier_quality.split_qqp``; banking77,
which it never saw) are split by a second hash into a calibration part, counted into
``policies/artifacts/bound_prior.json``, and a held-out part, the only one ``bench/error_bound.py``
replays. Calibration pairs sharing a question with a held-out pair are dropped. banking77 texts are
split the same way by their text; each calibration text is paired with its nearest neighbour among
the calibration texts (right when of the same intent), as the semantic tier would pair them.

    .venv/bin/python -m bench.prior_split [--data DIR] [--out policies/artifacts/bound_prior.json]
"""

from __future__ import annotations

import argparse
import csv
import hashlib
from pathlib import Path

import numpy as np

from bench.common import SHARED_DATA, say
from bench.verifier_quality import _norm_text, split_qqp

QQP_RULE = "QQP test split (split_qqp); calibration if int(sha1('prior:'+id), 16) % 2 == 0, else held out"
BANKING_RULE = "banking77 texts: calibration if int(sha1('prior:'+text), 16) % 2 == 0, else held out"
OUT = Path(__file__).resolve().parents[1] / "policies" / "artifacts" / "bound_prior.json"

Rows = list[dict[str, str]]


def calibration(key: str) -> bool:
    return int(hashlib.sha1(f"prior:{key}".encode()).hexdigest(), 16) % 2 == 0


def qqp_parts(rows: Rows) -> tuple[Rows, Rows]:
    """(calibration, held out) of the QQP test split; no calibration pair shares a held-out question."""
    _, test, _ = split_qqp(rows)
    held = [r for r in test if not calibration(r["id"])]
    seen = {_norm_text(r[k]) for r in held for k in ("question1", "question2")}
    calib = [r for r in test if calibration(r["id"])]
    calib = [r for r in calib if not ({_norm_text(r["question1"]), _norm_text(r["question2"])} & seen)]
    return calib, held


def banking_parts(rows: Rows) -> tuple[Rows, Rows]:
    """(calibration, held out) banking77 rows, by their text."""
    calib = [r for r in rows if calibration(r["text"])]
    return calib, [r for r in rows if not calibration(r["text"])]


def read(data: Path, name: str) -> Rows:
    with open(data / name, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def nearest_pairs(rows: Rows) -> tuple[list[str], list[str], np.ndarray]:
    """Each text with its nearest other text (the gateway's encoder), right when of the same intent."""
    from cachegw.gateway.offline.calibrate import gateway_encoder

    texts = [r["text"] for r in rows]
    emb = gateway_encoder("auto").encode(texts, show_progress=False)
    sims = emb @ emb.T
    np.fill_diagonal(sims, -1.0)
    nn = sims.argmax(axis=1)
    same = np.array([rows[i]["category"] == rows[j]["category"] for i, j in enumerate(nn)])
    return texts, [texts[j] for j in nn], same


def main() -> None:
    from cachegw.gateway.cache.verifier_loader import load_verifier
    from cachegw.gateway.config import load_settings
    from cachegw.gateway.offline.bound_prior import prior_counts, prior_document, sha256, write_prior

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=SHARED_DATA)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    settings = load_settings(None)
    verifier = load_verifier(settings.cache, settings.engine.resolved_cache_dir)
    qqp, _ = qqp_parts(read(args.data, "qqp_dev.csv"))
    bank, _ = banking_parts(read(args.data, "banking77_train.csv"))
    say(f"calibration: {len(qqp)} QQP pairs, {len(bank)} banking77 texts")
    q1 = [r["question1"] for r in qqp]
    q2 = [r["question2"] for r in qqp]
    y = np.array([r["is_duplicate"] == "1" for r in qqp])
    b1, b2, by = nearest_pairs(bank)
    parts = {
        "qqp": prior_counts(q1, q2, y, settings, verifier),
        "banking77": prior_counts(b1, b2, by, settings, verifier),
    }
    total = {
        k: type(parts["qqp"][k])(
            tuple(a + b for a, b in zip(parts["qqp"][k].audits, parts["banking77"][k].audits, strict=True)),
            tuple(a + b for a, b in zip(parts["qqp"][k].wrong, parts["banking77"][k].wrong, strict=True)),
        )
        for k in parts["qqp"]
    }
    doc = prior_document(
        total,
        settings,
        {
            "data": {
                "qqp_dev.csv": {
                    "sha256": sha256(args.data / "qqp_dev.csv"),
                    "rule": QQP_RULE,
                    "pairs": len(qqp),
                },
                "banking77_train.csv": {
                    "sha256": sha256(args.data / "banking77_train.csv"),
                    "rule": BANKING_RULE,
                    "pairs": len(bank),
                    "pairing": "each calibration text with its nearest calibration text; right = same intent",
                },
            },
            "pairs": len(qqp) + len(bank),
            "parts": {
                name: {k: {"audits": list(c.audits), "wrong": list(c.wrong)} for k, c in kinds.items()}
                for name, kinds in parts.items()
            },
            "command": "python -m bench.prior_split --out policies/artifacts/bound_prior.json",
        },
    )
    write_prior(args.out, doc)
    say(f"wrote {args.out}: candidates {doc['provenance']['candidates']}")


if __name__ == "__main__":
    main()
