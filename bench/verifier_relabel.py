"""How much of the verifier's QQP "precision" gap is the labels? A blind re-annotation of what it accepts.

Usage (from the project root):
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.verifier_relabel sample --out DIR [--rejected N]
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.verifier_relabel score

``sample`` writes pairs not judged yet into DIR/judge_in.csv (item, question_a, question_b; order within a
pair shuffled; no label, no score) for annotators, and appends them to
``bench/results/qqp_relabel/key.csv`` (item, QQP id, QQP label, how it was drawn: ids only, the question
texts stay in ../shared/data). Without ``--rejected`` it takes, from what the shipped verifier (default, and
MLP only) accepts on the held-out QQP split, every pair labelled "not duplicate" and as many randomly drawn
labelled duplicates (for precision). With ``--rejected N`` it draws N random pairs of each QQP label among
those the default rejects (for recall). Each annotator's answers go to
``bench/results/qqp_relabel/judge_<name>.csv`` (item, duplicate, sure); the guideline they were given is
GUIDELINE.md there.

``score`` reports inter-annotator agreement (Cohen's kappa), how often the annotators call QQP's accepted
negatives and positives duplicates, and each setting's precision (and, for the default, recall) against the
labels the annotators agree on, estimated per stratum with a 95% bootstrap interval (``relabelled``), and
the QQP precision a verifier would get if it made no mistake by the annotators' reading (the label-noise
ceiling at this operating point). Writes bench/results/verifier_relabel.json.
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
from cachegw.gateway.cache.verifier_loader import load_verifier  # noqa: E402
from cachegw.gateway.config import load_settings  # noqa: E402
from cachegw.policies.verifier import DEFAULT_RULE, Verifier  # noqa: E402

RELABEL_DIR = RESULTS_DIR / "qqp_relabel"
KEY = RELABEL_DIR / "key.csv"
# ref_a / ref_b ("<QQP id>:<1|2>", the question as shown to annotators first / second): replay rows only
KEY_COLUMNS = ("item", "qqp_id", "qqp_label", "drawn", "ref_a", "ref_b")


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
    """Rows of item, qqp_id, qqp_label, drawn ("accepted": from the accepted sets; "rejected": a uniform
    draw, per QQP label, from the pairs the default rejected when it was drawn)."""
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


def sample(out_dir: Path, seed: int, rejected: int) -> int:
    _, test, _ = split_qqp(_read_csv("qqp_dev.csv"))
    sets = accepted_sets(test)
    y = np.array([r["is_duplicate"] == "1" for r in test])
    union = np.logical_or.reduce(list(sets.values()))
    key = read_key()
    judged = {k["qqp_id"] for k in key}
    rng = random.Random(seed)
    fresh = [i for i in range(len(test)) if test[i]["id"] not in judged]
    if rejected:  # for recall: what the default turns away, uniformly, per QQP label
        todo = [(i, "rejected") for lab in (True, False) for i in rng.sample(
            [i for i in fresh if not sets["default"][i] and y[i] == lab], rejected
        )]  # fmt: skip
    else:  # for precision: every accepted QQP negative, and as many accepted QQP positives
        fps = [i for i in fresh if union[i] and not y[i]]
        n_tp = sum(1 for k in key if k["qqp_label"] == "1" and k["drawn"] == "accepted")
        n_fp = sum(1 for k in key if k["qqp_label"] == "0" and k["drawn"] == "accepted") + len(fps)
        pool = [i for i in fresh if union[i] and y[i]]
        todo = [(i, "accepted") for i in fps + rng.sample(pool, min(len(pool), max(0, n_fp - n_tp)))]
    rng.shuffle(todo)
    start = max((int(k["item"]) for k in key), default=-1) + 1
    RELABEL_DIR.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    new_key = not KEY.exists()
    with KEY.open("a", newline="") as fk, (out_dir / "judge_in.csv").open("w", newline="") as fj:
        wk, wj = csv.writer(fk), csv.writer(fj)
        if new_key:
            wk.writerow(["item", "qqp_id", "qqp_label", "drawn"])
        wj.writerow(["item", "question_a", "question_b"])
        for n, (i, drawn) in enumerate(todo, start):
            a, b = test[i]["question1"], test[i]["question2"]
            if rng.random() < 0.5:
                a, b = b, a
            wk.writerow([n, test[i]["id"], test[i]["is_duplicate"], drawn])
            wj.writerow([n, a, b])
    print(f"{len(todo)} new pairs to judge -> {out_dir}")
    return 0


def sample_replay(out_dir: Path, seed: int, pairs: int, replay_seed: int, batch: int) -> int:
    """Every candidate of the held-out QQP replay scoring at least 0.50 (``bench/replay_candidates.py``)
    not judged yet, in batches of about ``batch`` (out_dir/batch_NN.csv), key rows "replay"."""
    from bench.common import SHARED_DATA
    from bench.prior_split import meanings
    from bench.replay_candidates import replay_candidates

    test, cands = replay_test(), replay_candidates(SHARED_DATA, pairs, replay_seed)
    key = read_key()
    judged = judged_pairs(key, test)
    by_pair = {frozenset((_norm(r["question1"]), _norm(r["question2"]))): r for r in test}
    find = meanings(test)
    todo, seen = [], set(judged)
    for c in cands:
        pair = frozenset((_norm(c.request), _norm(c.stored)))
        if pair not in seen:
            seen.add(pair)
            todo.append(c)
    rng = random.Random(seed)
    rng.shuffle(todo)
    start = max((int(k["item"]) for k in key), default=-1) + 1
    rows = []
    for n, c in enumerate(todo, start):
        (a, ra), (b, rb) = (c.request, c.request_ref), (c.stored, c.stored_ref)
        if rng.random() < 0.5:
            (a, ra), (b, rb) = (b, rb), (a, ra)
        qqp = by_pair.get(frozenset((_norm(a), _norm(b))))
        label = int(find(a) == find(b))  # what the replay's labels-following backend answers
        rows.append(([n, qqp["id"] if qqp else "", label, "replay", ra, rb], [n, a, b]))
    write_key([r for r, _ in rows])
    out_dir.mkdir(parents=True, exist_ok=True)
    n_batches = max(1, -(-len(rows) // batch))  # at most ``batch`` each
    names = []
    for b_i in range(n_batches):
        part = rows[b_i * len(rows) // n_batches : (b_i + 1) * len(rows) // n_batches]
        name = f"batch_{b_i + 1:02d}.csv"
        with (out_dir / name).open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["item", "question_a", "question_b"])
            w.writerows(j for _, j in part)
        names.append((name, len(part), part[0][0][0], part[-1][0][0]))
    distinct = {frozenset((_norm(c.request), _norm(c.stored))) for c in cands}
    print(
        f"{len(cands)} candidates scoring >= 0.50 ({len(distinct)} distinct pairs), "
        f"{len(distinct & judged.keys())} already judged, {len(todo)} new -> {out_dir}"
    )
    for name, n, first, last in names:
        print(f"  {name}: {n} pairs, items {first}-{last}")
    return 0


def _norm(t: str) -> str:
    return " ".join(t.lower().split())


def replay_test() -> list[dict[str, str]]:
    return split_qqp(_read_csv("qqp_dev.csv"))[1]


def judged_pairs(key: list[dict[str, str]], test: list[dict[str, str]]) -> dict[frozenset[str], str]:
    """{normalized text pair: item} of every key row (QQP pairs by id, replay pairs by their refs)."""
    by_id = {r["id"]: r for r in test}
    out = {}
    for k in key:
        a, b = pair_texts(k, by_id)
        out[frozenset((_norm(a), _norm(b)))] = k["item"]
    return out


def pair_texts(k: dict[str, str], by_id: dict[str, dict[str, str]]) -> tuple[str, str]:
    """The two question texts of a key row: its refs ("<id>:<side>") or else its QQP pair."""
    if k.get("ref_a"):
        return tuple(by_id[r.split(":")[0]][f"question{r.split(':')[1]}"] for r in (k["ref_a"], k["ref_b"]))  # type: ignore[return-value]
    r = by_id[k["qqp_id"]]
    return r["question1"], r["question2"]


def write_key(rows: list[list[Any]]) -> None:
    """Append rows to key.csv, first widening an old file to the ref columns (empty for QQP pairs)."""
    old = read_key()
    with KEY.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(KEY_COLUMNS)
        w.writerows([k.get(c) or "" for c in KEY_COLUMNS] for k in old)
        w.writerows(rows)


def _kappa(a: np.ndarray, b: np.ndarray) -> float:
    po = float((a == b).mean())
    pe = float(a.mean() * b.mean() + (1 - a.mean()) * (1 - b.mean()))
    return (po - pe) / (1 - pe) if pe < 1 else 1.0


def relabelled(
    acc: np.ndarray,
    y: np.ndarray,
    agreed: dict[int, int],
    draws: dict[str, set[int]],
    rng: np.random.Generator,
) -> dict[str, Any]:
    """Precision (and recall, given uniform draws among rejected pairs) against the agreed labels.

    ``agreed`` maps test index -> 1 if both annotators said duplicate. Four strata: accepted QQP
    negatives (all judged; unjudged ones count as wrong), accepted QQP positives (a sample), and rejected
    QQP positives / negatives (uniform samples). Each stratum's duplicate rate times its size estimates its
    true duplicates; the 95% interval resamples every stratum's judged items.
    """
    strata = {
        "accepted_qqp_negative": acc & ~y,
        "accepted_qqp_positive": acc & y,
        "rejected_qqp_positive": ~acc & y,
        "rejected_qqp_negative": ~acc & ~y,
    }
    sizes, votes = {}, {}
    for name, mask in strata.items():
        idx = [int(i) for i in np.flatnonzero(mask)]
        pool = [i for i in idx if i in draws[name.split("_")[0]]]  # only items drawn for this stratum
        v = [agreed[i] for i in pool if i in agreed]
        if name == "accepted_qqp_negative":
            v += [0] * (len(idx) - len(v))
        sizes[name], votes[name] = len(idx), np.array(v, dtype=float)

    def estimate(rate: dict[str, float]) -> tuple[float, float | None]:
        acc_dup = sizes["accepted_qqp_negative"] * rate["accepted_qqp_negative"]
        acc_dup += sizes["accepted_qqp_positive"] * rate["accepted_qqp_positive"]
        precision = acc_dup / max(int(acc.sum()), 1)
        if not all(len(votes[k]) for k in ("rejected_qqp_positive", "rejected_qqp_negative")):
            return precision, None
        rej_dup = sum(sizes[k] * rate[k] for k in ("rejected_qqp_positive", "rejected_qqp_negative"))
        return precision, acc_dup / max(acc_dup + rej_dup, 1e-9)

    def perfect(rate: dict[str, float]) -> tuple[float, float | None]:
        """QQP precision of a verifier that keeps only the annotators' duplicates among these accepted
        pairs, and (with the rejected strata judged) of one that accepts every such duplicate."""
        pos = sizes["accepted_qqp_positive"] * rate["accepted_qqp_positive"]
        neg = sizes["accepted_qqp_negative"] * rate["accepted_qqp_negative"]
        if not all(len(votes[k]) for k in ("rejected_qqp_positive", "rejected_qqp_negative")):
            return pos / max(pos + neg, 1e-9), None
        all_pos = pos + sizes["rejected_qqp_positive"] * rate["rejected_qqp_positive"]
        all_neg = neg + sizes["rejected_qqp_negative"] * rate["rejected_qqp_negative"]
        return pos / max(pos + neg, 1e-9), all_pos / max(all_pos + all_neg, 1e-9)

    point = estimate({k: float(v.mean()) if len(v) else 0.0 for k, v in votes.items()})
    rates = [{k: float(v.mean()) if len(v) else 0.0 for k, v in votes.items()}]
    for _ in range(2000):
        rates.append({k: float(rng.choice(v, len(v)).mean()) if len(v) else 0.0 for k, v in votes.items()})
    boots = [estimate(r) for r in rates[1:]]
    ideal = [perfect(r) for r in rates]
    out: dict[str, Any] = {
        "accepted": int(acc.sum()),
        "qqp_precision": round(float((acc & y).sum() / max(acc.sum(), 1)), 4),
        "qqp_recall": round(float((acc & y).sum() / y.sum()), 4),
        "strata": {k: {"pairs": sizes[k], "judged": len(votes[k]), "both_call_duplicate_rate":
                       round(float(votes[k].mean()), 4) if len(votes[k]) else None} for k in strata},
        "precision_against_agreed_relabel": round(point[0], 4),
        "precision_ci95": [round(float(np.percentile([b[0] for b in boots], q)), 4) for q in (2.5, 97.5)],
    }  # fmt: skip
    if point[1] is not None:
        out["recall_against_agreed_relabel"] = round(point[1], 4)
        out["recall_ci95"] = [round(float(np.percentile([b[1] for b in boots], q)), 4) for q in (2.5, 97.5)]
    # What QQP's labels allow: a verifier that never errs by the annotators' reading still scores this
    out["qqp_precision_if_only_agreed_duplicates_kept"] = round(ideal[0][0], 4)
    out["qqp_precision_if_only_agreed_duplicates_kept_ci95"] = [
        round(float(np.percentile([b[0] for b in ideal[1:]], q)), 4) for q in (2.5, 97.5)
    ]
    if ideal[0][1] is not None:
        out["qqp_precision_if_every_agreed_duplicate_accepted"] = round(ideal[0][1], 4)
    return out


def replay_agreement(
    items: list[dict[str, str]], votes: np.ndarray, lab: np.ndarray, drawn: np.ndarray
) -> dict:
    """The replay's new items (``sample --replay``): agreement, kappa, and how often both annotators
    call duplicate what QQP's links join (label 1: the replay counted them right) and what they do not."""
    m = drawn == "replay"
    if not m.any():
        return {}
    v, both = votes[m], votes[m].all(axis=1)
    return {
        "items_judged_by_all": int(m.sum()),
        "agreement": round(float((v[:, 0] == v[:, 1]).mean()), 4),
        "cohen_kappa": round(_kappa(v[:, 0], v[:, 1]), 4),
        **{
            f"qqp_{name}": {
                "items": int((lab[m] == y).sum()),
                "both_call_duplicate": int(both[lab[m] == y].sum()),
                "both_call_not_duplicate": int((~v.any(axis=1))[lab[m] == y].sum()),
            }
            for name, y in (("joined", 1), ("not_joined", 0))
        },
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
    drawn = np.array([k["drawn"] for k in items])
    res: dict[str, Any] = {
        "annotators": names,
        "items_judged_by_all": len(items),
        "items_in_key": len(key),
        "agreement": round(float((votes[:, 0] == votes[:, 1]).mean()), 4),
        "cohen_kappa": round(_kappa(votes[:, 0], votes[:, 1]), 4),
        "accepted_qqp_negatives_called_duplicate_by_both": round(
            float(both[(lab == 0) & (drawn == "accepted")].mean()), 4
        ),
        "accepted_qqp_positives_called_duplicate_by_both": round(
            float(both[(lab == 1) & (drawn == "accepted")].mean()), 4
        ),
    }
    res["replay"] = replay_agreement(items, votes, lab, drawn)
    # the precision strata are QQP's own pairs (replay rows may pair two QQP pairs' questions)
    agreed = {row[k["qqp_id"]]: int(b) for k, b, d in zip(items, both, drawn, strict=True) if d != "replay"}
    y = np.array([r["is_duplicate"] == "1" for r in test])
    rng = np.random.default_rng(0)
    sets = accepted_sets(test)
    drawn_as = {d: {row[k["qqp_id"]] for k in key if k["drawn"] == d} for d in ("accepted", "rejected")}
    for name, acc in sets.items():  # the rejected draws are uniform only among the default's rejections
        draws = drawn_as if name == "default" else {**drawn_as, "rejected": set()}
        res[name] = relabelled(acc, y, agreed, draws, rng)
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
    s.add_argument("--rejected", type=int, default=0, help="instead: N random rejected pairs per QQP label")
    s.add_argument("--replay", action="store_true", help="instead: the held-out replay's candidates")
    s.add_argument("--pairs", type=int, default=1500, help="--replay: pairs replayed (error_bound --prior)")
    s.add_argument("--replay-seed", type=int, default=17, help="--replay: the replay's seed")
    s.add_argument("--batch", type=int, default=150, help="--replay: pairs per batch file")
    sub.add_parser("score", help="agreement and precision against the re-annotation")
    args = ap.parse_args(argv)
    if args.cmd == "sample" and args.replay:
        return sample_replay(args.out, args.seed, args.pairs, args.replay_seed, args.batch)
    return sample(args.out, args.seed, args.rejected) if args.cmd == "sample" else score()


if __name__ == "__main__":
    raise SystemExit(main())
