"""The shipped false-hit prior's data, and the held-out part the replay measures it on.

Pairs the verifier never trained on (QQP's test split, ``bench/verifier_quality.split_qqp``; banking77,
which it never saw) are split by a second hash into a calibration part, counted into
``policies/artifacts/bound_prior.json``, and a held-out part, the only one ``bench/error_bound.py``
replays. Calibration pairs sharing a question with a held-out pair are dropped. banking77 texts are
split the same way by their text; each calibration text is paired with its nearest neighbour among
the calibration texts (right when of the same intent), as the semantic tier would pair them.

QQP's part counts the candidates a cache meets, not QQP's curated pairs: the calibration questions are
stored in order as the replay stores them (each pair's question 1, then question 2), and each is
judged against its nearest earlier stored questions (``stored_neighbours``), right when QQP's
duplicate links join the two, as the replay's backend answers.

The two are written as separate families (``families`` in the file): their false-hit rates differ
tenfold, and the gateway weighs them per scope by its own audits (``policies/prior_families.py``).

    .venv/bin/python -m bench.prior_split [--data DIR] [--out policies/artifacts/bound_prior.json]
"""

from __future__ import annotations

import argparse
import csv
import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import SHARED_DATA, say
from bench.verifier_quality import _norm_text, split_qqp

QQP_RULE = "QQP test split (split_qqp); calibration if int(sha1('prior:'+id), 16) % 2 == 0, else held out"
BANKING_RULE = "banking77 texts: calibration if int(sha1('prior:'+text), 16) % 2 == 0, else held out"
QQP_PAIRING = (
    "the calibration pairs' questions stored in order (question 1, then question 2; a repeat is an exact"
    " hit, not stored again); each judged against its 4 nearest earlier stored questions at or over the"
    " cosine floor, nearest first, the first the guards and verifier accept counting; right = QQP's"
    " duplicate links among the calibration pairs join the two (transitively; unlabelled = not a duplicate)"
)
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
    emb = gateway_encoder("auto").encode(texts)
    sims = emb @ emb.T
    np.fill_diagonal(sims, -1.0)
    nn = sims.argmax(axis=1)
    same = np.array([rows[i]["category"] == rows[j]["category"] for i, j in enumerate(nn)])
    return texts, [texts[j] for j in nn], same


def meanings(rows: Rows) -> Callable[[str], str]:
    """Each question's meaning: the class QQP's duplicate links among ``rows`` join it to
    (transitively); a pair no link joins is not a duplicate."""
    return union_find((r["question1"], r["question2"]) for r in rows if r["is_duplicate"] == "1")


def union_find(links: Iterable[tuple[str, str]]) -> Callable[[str], str]:
    """A text -> the representative of the class ``links`` join it to (itself where none does)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for x, y in links:
        a, b = find(x), find(y)
        if a != b:
            parent[a] = b
    return find


def stored_neighbours(
    rows: Rows, cfg: Any, floor: float
) -> tuple[list[str], list[str], np.ndarray, np.ndarray]:
    """(query, stored neighbour, right, query index) per candidate pair: each question, in the order
    stored, against its ``CANDIDATES`` nearest earlier stored questions at or over the cosine floor,
    nearest first. A repeat of a stored question is an exact hit, not a candidate, and is not stored
    again; every other question is stored (a cache stores misses, and hits are few). Right when the
    duplicate links among these pairs join the two questions (transitively, as the replay's
    backend: a pair QQP never labelled is not a duplicate)."""
    from cachegw.gateway.cache.semantic import CANDIDATES
    from cachegw.gateway.offline.calibrate import gateway_encoder, gateway_query

    find = meanings(rows)
    stored: list[str] = []
    keys: dict[str, int] = {}
    for q in (r[k] for r in rows for k in ("question1", "question2")):
        key = gateway_query(q, cfg)
        if key is not None and key not in keys:
            keys[key] = len(stored)
            stored.append(q)
    emb = gateway_encoder("auto").encode(list(keys))
    q1: list[str] = []
    q2: list[str] = []
    query: list[int] = []
    for start in range(1, len(stored), 1024):  # each question against those stored before it
        sims = emb[start : start + 1024] @ emb[: start + 1024].T
        for row, i in enumerate(range(start, min(start + 1024, len(stored)))):
            earlier = sims[row, :i]
            for j in np.argsort(-earlier)[:CANDIDATES]:
                if earlier[j] >= floor - 0.01:  # seed_scores applies the floor itself
                    q1.append(stored[i])
                    q2.append(stored[j])
                    query.append(i)
    right = np.array([find(a) == find(b) for a, b in zip(q1, q2, strict=True)])
    return q1, q2, right, np.array(query)


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
    q1, q2, y, query = stored_neighbours(qqp, settings.canonicalize, settings.cache.threshold)
    say(f"QQP: {len(q1)} stored-neighbour pairs of {len(set(query.tolist()))} questions")
    b1, b2, by = nearest_pairs(bank)
    parts = {
        "qqp": prior_counts(q1, q2, y, settings, verifier, query),
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
                    "pairing": QQP_PAIRING,
                },
                "banking77_train.csv": {
                    "sha256": sha256(args.data / "banking77_train.csv"),
                    "rule": BANKING_RULE,
                    "pairs": len(bank),
                    "pairing": "each calibration text with its nearest calibration text; right = same intent",
                },
            },
            "pairs": len(qqp) + len(bank),
            "command": "python -m bench.prior_split --out policies/artifacts/bound_prior.json",
        },
        parts,
    )
    write_prior(args.out, doc)
    say(f"wrote {args.out}: candidates {doc['provenance']['candidates']}")


if __name__ == "__main__":
    main()
