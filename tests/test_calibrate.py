"""`cachegw calibrate` against a direct computation with the real encoder and verifier (no mocks)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cachegw.embeddings.encoder import Encoder
from cachegw.gateway.cache.verifier_loader import load_verifier
from cachegw.gateway.config import load_settings
from cachegw.gateway.offline.calibrate import THRESHOLDS, gateway_query, main_calibrate
from cachegw.policies.verifier import DecisionRule

ROOT = Path(__file__).resolve().parents[1]

PAIRS = [
    ("How do I learn Python quickly?", "What is the fastest way to learn Python?", 1),
    ("How can I lose weight fast?", "What is the quickest way to lose weight?", 1),
    ("What is the capital of France?", "Which city is the capital of France?", 1),
    ("How do I reset my password?", "How can I reset my password?", 1),
    ("What are the benefits of meditation?", "What are the advantages of meditating?", 1),
    ("How do I improve my English speaking?", "How can I get better at speaking English?", 1),
    ("What is the best way to save money?", "What is the best way to save some money?", 1),
    ("How does a car engine work?", "How do car engines work?", 1),
    ("Why is the sky blue?", "Why does the sky look blue?", 1),
    ("How can I become a better programmer?", "How do I become a better programmer?", 1),
    ("What should I eat to build muscle?", "What foods help build muscle?", 1),
    ("How do I start a small business?", "How can I start my own small business?", 1),
    ("What is machine learning?", "What is machine learning exactly?", 1),
    ("How do I make my phone battery last longer?", "How can I make my phone's battery last longer?", 1),
    ("What causes earthquakes?", "Why do earthquakes happen?", 1),
    ("How do I cook rice?", "What is the right way to cook rice?", 1),
    ("what is 2+2", "what is 2+3", 0),
    ("What is the best phone under 15000?", "What is the best phone under 20000?", 0),
    ("How many days are in 2 weeks?", "How many days are in 3 weeks?", 0),
    ("Is coffee bad for you?", "Is coffee not bad for you?", 0),
    ("Can I take ibuprofen with alcohol?", "Can I not take ibuprofen with alcohol?", 0),
    ("Should I buy Bitcoin now?", "Should I sell Bitcoin now?", 0),
    ("What is the best programming language?", "What is the worst programming language?", 0),
    ("How do I bake bread?", "What is the best car to buy?", 0),
    ("Who won the World Cup in 2014?", "Who won the World Cup in 2018?", 0),
    ("What is the population of India?", "What is the population of China?", 0),
    ("How do I learn French?", "How do I learn German?", 0),
    ("What is the meaning of life?", "How do I fix a flat tire?", 0),
    ("Why do cats purr?", "Why do dogs bark?", 0),
    ("How tall is Mount Everest?", "How old is Mount Everest?", 0),
    ("What is the boiling point of water?", "What is the freezing point of water?", 0),
    ("How do I learn to swim?", "How do I learn to swim fast?", 0),
    ("Is it safe to travel to Mexico?", "Is it safe to travel to Mexico alone?", 0),
    ("What are good books for beginners in Python?", "What are good books for experts in Python?", 0),
    ("How do I get a job at Google?", "How do I get a job at Microsoft?", 0),
    ("What do men like in women?", "What do women like in men?", 0),
]


def _write_csv(path: Path, rows: list[tuple[str, str, int]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(("question1", "question2", "is_duplicate"))
        w.writerows(rows)
    return path


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder()


@pytest.fixture(scope="module")
def direct(encoder):
    """The reference: gateway pieces called by hand, pair by pair, at every threshold."""
    settings = load_settings()
    q1, q2 = [a for a, _, _ in PAIRS], [b for _, b, _ in PAIRS]
    y = np.array([lab for _, _, lab in PAIRS], dtype=bool)
    e1, e2 = encoder.encode(q1), encoder.encode(q2)
    cos = np.sum(e1 * e2, axis=1)
    verifier = load_verifier(settings.cache, settings.engine.resolved_cache_dir)  # as the gateway does
    assert verifier.cross is not None  # the shipped config has the cross-encoder stage on

    def curve(use_verifier: bool) -> dict[str, list]:
        out: dict[str, list] = {"precision": [], "recall": [], "f1": [], "accepted": []}
        for t in THRESHOLDS:
            if use_verifier:
                rule = DecisionRule(min_cosine=t, min_prob=settings.cache.verifier.threshold)
                acc = np.array([v.accepted for v in verifier.check_batch(q1, q2, e1, e2, rule)])
            else:
                acc = np.array([float(c) >= t for c in cos])
            tp, fp, fn = int((acc & y).sum()), int((acc & ~y).sum()), int((~acc & y).sum())
            out["accepted"].append(tp + fp)
            out["precision"].append(tp / (tp + fp) if tp + fp else None)
            out["recall"].append(tp / (tp + fn))
            out["f1"].append(2 * tp / (2 * tp + fp + fn))
        return out

    return {"verifier": curve(True), "cosine": curve(False), "positives": int(y.sum()), "cos": cos}


@pytest.fixture
def pairs_csv(tmp_path) -> Path:
    return _write_csv(tmp_path / "pairs.csv", PAIRS)


def _run_json(capsys, argv: list[str]) -> dict:
    assert main_calibrate([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _check_against(res: dict, ref: dict, target: float) -> None:
    assert res["thresholds"] == list(THRESHOLDS)
    assert res["accepted"] == ref["accepted"]
    for key in ("precision", "recall", "f1"):
        for got, want in zip(res[key], ref[key], strict=True):
            assert (got is None and want is None) or got == pytest.approx(want, abs=5e-5), key
    meeting = [t for t, p in zip(THRESHOLDS, ref["precision"], strict=True) if p is not None and p >= target]
    assert meeting, "the sample should let some threshold meet the target"
    assert res["recommended"] == meeting[0]
    i = THRESHOLDS.index(meeting[0])
    assert res["precision_at_recommended"] == pytest.approx(ref["precision"][i], abs=5e-5)
    assert res["recall_at_recommended"] == pytest.approx(ref["recall"][i], abs=5e-5)
    assert res["target_met"] is True and res["target_precision"] == target


def test_texts_are_what_the_gateway_embeds():
    cfg = load_settings().canonicalize
    assert all(gateway_query(q, cfg) == q for pair in PAIRS for q in pair[:2])


def test_json_matches_direct_computation_with_verifier(capsys, pairs_csv, direct):
    res = _run_json(capsys, ["--pairs", str(pairs_csv)])
    assert res["verifier"] is True and res["pairs"] == len(PAIRS)
    assert res["positives"] == direct["positives"]
    _check_against(res, direct["verifier"], 0.95)
    # the guards veto the number/negation/antonym pairs that cosine alone lets through
    i = THRESHOLDS.index(0.85)
    assert res["precision"][i] > direct["cosine"]["precision"][i]


def test_no_verifier_is_cosine_alone(capsys, pairs_csv, direct):
    res = _run_json(capsys, ["--pairs", str(pairs_csv), "--no-verifier", "--precision", "0.8"])
    assert res["verifier"] is False
    _check_against(res, direct["cosine"], 0.8)


def test_unreachable_target_recommends_most_precise(capsys, tmp_path, direct):
    """A negative above every positive (by cosine) makes precision 1 unreachable for cosine alone."""
    cos = direct["cos"]
    top = max((i for i, p in enumerate(PAIRS) if not p[2]), key=lambda i: cos[i])
    rows = [PAIRS[top]] + [p for i, p in enumerate(PAIRS) if p[2] and cos[i] < cos[top]]
    path = _write_csv(tmp_path / "hard.csv", rows)
    assert main_calibrate(["--pairs", str(path), "--no-verifier", "--precision", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)
    assert res["target_met"] is False and "cachegw calibrate: warning:" in err
    defined = [(p, -k) for k, p in enumerate(res["precision"]) if p is not None]
    best_p, neg_k = max(defined)
    assert res["recommended"] == THRESHOLDS[-neg_k] and res["precision_at_recommended"] == best_p < 1


def test_table_output(capsys, pairs_csv):
    assert main_calibrate(["--pairs", str(pairs_csv), "--limit", "20"]) == 0
    out = capsys.readouterr().out
    assert "threshold" in out and "0.85" in out and "recommended [cache] threshold = " in out


def test_write_config_keeps_comments(capsys, pairs_csv, tmp_path):
    cfg = tmp_path / "my.toml"
    cfg.write_text("# my gateway\n[cache]\nthreshold = 0.5  # old value\nexact = true\n", encoding="utf-8")
    plot = tmp_path / "curve.png"
    res = _run_json(capsys, ["--pairs", str(pairs_csv), "--write-config", str(cfg), "--plot", str(plot)])
    text = cfg.read_text(encoding="utf-8")
    assert "# my gateway" in text and "# old value" in text and "exact = true" in text
    assert load_settings(cfg).cache.threshold == res["recommended"]
    assert plot.read_bytes()[:4] == b"\x89PNG"
    fresh = tmp_path / "new.toml"
    res = _run_json(capsys, ["--pairs", str(pairs_csv), "--write-config", str(fresh)])
    assert load_settings(fresh).cache.threshold == res["recommended"]


@pytest.mark.parametrize(
    "case, content, extra, expect",
    [
        ("missing columns", "question1,question2,label\na,b,1\n", [], "missing column(s) is_duplicate"),
        ("empty file", "", [], "empty file"),
        ("header only", "question1,question2,is_duplicate\n", [], "no pairs"),
        ("missing file", None, [], "no such file"),
        ("bad labels", "question1,question2,is_duplicate\na,b,maybe\n", [], "must be 0 or 1"),
        ("one class", "question1,question2,is_duplicate\na,b,1\nc,d,1\n", [], "both duplicate"),
        ("precision 0", PAIRS, ["--precision", "0"], "must be in (0, 1]"),
        ("precision 1.5", PAIRS, ["--precision", "1.5"], "must be in (0, 1]"),
        ("precision abc", PAIRS, ["--precision", "abc"], "not a number"),
        ("limit one class", PAIRS, ["--limit", "3"], "first 3 pairs need both"),
    ],
)
def test_bad_input(capsys, tmp_path, case, content, extra, expect):
    path = tmp_path / "in.csv"
    if isinstance(content, list):
        _write_csv(path, content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    assert main_calibrate(["--pairs", str(path), *extra]) == 2, case
    err = capsys.readouterr().err
    assert "cachegw calibrate: error:" in err and expect in err and "Traceback" not in err


def test_cli_reports_bad_input_without_traceback(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text("q1,q2,is_duplicate\na,b,1\n", encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "cachegw.gateway.cli", "calibrate", "--pairs", str(path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("cachegw calibrate: error:") and "question1, question2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_seed_evidence_writes_the_candidates_for_the_error_bound(capsys, pairs_csv, tmp_path):
    """`--seed-evidence MODEL`: candidate pairs (over the cosine threshold, no guard) become rows of
    the gateway's hit_audits table, duplicates as right hits; a gateway reads them at start."""
    from cachegw.gateway.cache.error_control import ThresholdProvider
    from cachegw.gateway.storage.evidence_store import EvidenceStore
    from cachegw.gateway.storage.store import Store

    cfg = tmp_path / "my.toml"
    cfg.write_text(f'[gateway]\ndata_dir = "{tmp_path / "data"}"\n', encoding="utf-8")
    res = _run_json(
        capsys, ["--pairs", str(pairs_csv), "--config", str(cfg), "--seed-evidence", "m", "--tenant", "t"]
    )
    store = Store(f"sqlite:///{tmp_path / 'data' / 'cachegw.db'}")
    try:
        rows = EvidenceStore(store.session).since(0.0)
        lines = ThresholdProvider(EvidenceStore(store.session), lambda: 0.0)
        lines.load()
    finally:
        store.close()
    assert 0 < len(rows) == res["seeded"] < len(PAIRS)  # the far and guarded pairs are no candidates
    assert {(r.model, r.tenant, r.source) for r in rows} == {("m", "t", "seed")}
    assert any(r.right for r in rows) and all(0.0 <= r.score <= 1.0 for r in rows)
    assert lines.evidence[("m", "t")].total == sum(r.score >= 0.5 for r in rows)
