"""`cachegw analyze` and `cachegw export` on a small request log written here, in a real SQLite file.

The expected numbers are computed in this file from the rows it wrote (not through gateway.storage.stats), so
a wrong formula in the report shows up as a mismatch.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from cachegw.gateway.offline.analyze import main_analyze, main_export
from cachegw.gateway.storage.recorder import SqlRequestLog
from cachegw.gateway.storage.request_record import RequestRecord
from cachegw.gateway.storage.store import Store
from cachegw.gateway.storage.tables import Feedback, RequestRow

ROOT = Path(__file__).resolve().parent.parent
BASE = datetime(2025, 3, 1, 10, 0, tzinfo=UTC).timestamp()
RANGE = ["--since", "2025-03-01T09:00", "--until", "2025-03-01T14:00"]
RESULTS = ["miss", "semantic-hit", "exact-hit", "miss", "bypass", "semantic-hit", "miss", "miss"]
RULES = ["", "trailing_whitespace", "volatile_to_tail,merge_system", "unicode_nfc", ""]
PNGS = [
    "hit_ratio_over_time.png",
    "similarity.png",
    "hits_by_model_tenant.png",
    "prefix_cache_by_system.png",
    "rules.png",
    "latency_cost.png",
    "threshold_sweep.png",
]
# Default [pricing] of the packaged config.toml: USD per million tokens.
IN, OUT, CACHED_DISCOUNT = 0.15, 0.60, 0.5


def make_row(i: int, ts: float) -> dict:
    """Row i of the log: 2 models, 2 tenants, a cycle of results, similarities, rules and tokens."""
    result = RESULTS[i % len(RESULTS)]
    semantic = result in ("semantic-hit", "miss")
    backend = result in ("miss", "bypass")
    return {
        "id": f"req-{i:03d}",
        "ts": ts,
        "tenant": "tenant-a" if i % 4 < 2 else "tenant-b",
        "model": "small-model" if i % 2 else "large-model",
        "endpoint": "chat",
        "stream": i % 3 == 0,
        "cache_result": result,
        "similarity": round(0.70 + (i * 7 % 30) / 100, 2) if semantic else None,
        "threshold": 0.88 if semantic else None,
        "entry_id": i if result.endswith("hit") else None,
        "rules_fired": RULES[i % len(RULES)],
        "embed_ms": 3.0,
        "lookup_ms": 1.0,
        "backend_ms": 400.0 + 10 * i if backend else None,
        "total_ms": 420.0 + 10 * i if backend else 5.0 + i,
        "prompt_tokens": 20_000 + 1000 * i,
        "completion_tokens": 500 + 10 * i,
        "cached_tokens": (1000 * (i % 7)) if backend else None,
        "status": 200,
        "error": None,
        "response_id": f"chatcmpl-{i}",
        "stored_entry_id": None,
        "scope": f"scope-{i % 3}",
        "system_hash": ["sys-a", "sys-b", None][i % 3],
        "query_hash": f"q{i % 6}",
        "query": f"question number {i % 6}?" if i % 6 != 5 else None,
    }


@pytest.fixture(scope="module")
def log_db(tmp_path_factory) -> tuple[str, list[dict], set[str], Path]:
    """40 rows over 3 hours in range, 2 rows a day earlier (out of range), 2 flagged semantic hits."""
    tmp = tmp_path_factory.mktemp("log")
    url = f"sqlite:///{tmp}/cachegw.db"
    rows = [make_row(i, BASE + 270 * i) for i in range(40)]
    old = [make_row(40 + i, BASE - 86400 + i) for i in range(2)]
    store = Store(url)
    SqlRequestLog(store.session).log_requests([RequestRecord.from_dict(r) for r in rows + old])
    flagged = [r for r in rows if r["cache_result"] == "semantic-hit"][:2]
    with store.session.begin() as s:
        for r in flagged:
            s.add(
                Feedback(
                    ts=r["ts"] + 60,
                    request_id=r["id"],
                    entry_id=r["entry_id"],
                    tenant=r["tenant"],
                    actor="test",
                    verdict="bad",
                    cache_result=r["cache_result"],
                    similarity=r["similarity"],
                )
            )
    store.close()
    return url, rows, {r["id"] for r in flagged}, tmp


def analyze_json(args: list[str], capsys) -> dict:
    assert main_analyze([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def hits(rows: list[dict]) -> int:
    return sum(1 for r in rows if r["cache_result"] in ("exact-hit", "semantic-hit"))


def test_numbers_match_a_direct_computation(log_db, tmp_path, capsys):
    url, rows, flagged, _ = log_db
    s = analyze_json(["--db", url, *RANGE, "--out", str(tmp_path / "r")], capsys)
    o = s["overall"]
    assert o["requests"] == 40
    assert o["hit_ratio"] == round(hits(rows) / 40, 4)
    assert o["flagged"] == 2
    for model in ("small-model", "large-model"):
        mine = [r for r in rows if r["model"] == model]
        assert s["by_model"][model]["requests"] == len(mine) == 20
        assert s["by_model"][model]["exact_hits"] == sum(r["cache_result"] == "exact-hit" for r in mine)
        assert s["by_model"][model]["hit_ratio"] == round(hits(mine) / len(mine), 4)
    assert {t: g["requests"] for t, g in s["by_tenant"].items()} == {"tenant-a": 20, "tenant-b": 20}

    backend = [r for r in rows if r["cache_result"] in ("miss", "bypass")]
    by_system = {p["system_hash"]: p for p in s["prefix_cache_by_system"]}
    for h, name in (("sys-a", "sys-a"), ("sys-b", "sys-b"), (None, "(none)")):
        mine = [r for r in backend if r["system_hash"] == h]
        expected = sum(r["cached_tokens"] for r in mine) / sum(r["prompt_tokens"] for r in mine)
        assert by_system[name]["prefix_cache_ratio"] == round(expected, 4)
        assert by_system[name]["requests"] == len(mine)

    saved = 0.0
    for r in rows:
        if r["cache_result"] in ("exact-hit", "semantic-hit"):
            saved += (r["prompt_tokens"] * IN + r["completion_tokens"] * OUT) / 1e6
        else:
            saved += (r["cached_tokens"] or 0) * IN * CACHED_DISCOUNT / 1e6
    assert o["cost_saved_usd"] == pytest.approx(saved, abs=2e-6)

    curve = {p["threshold"]: p for p in s["threshold_sweep"]["curve"]}
    looked_up = [r for r in rows if r["cache_result"] in ("semantic-hit", "miss")]
    for t in (0.80, 0.90):
        above = [r for r in looked_up if r["similarity"] >= t]
        assert curve[t]["candidates"] == len(above)
        assert curve[t]["new_candidates"] == sum(r["cache_result"] == "miss" for r in above)
        assert curve[t]["known_false"] == sum(r["id"] in flagged for r in above)
    assert s["threshold_sweep"]["current"]["threshold"] == 0.88

    top = s["top_queries"][0]
    same = [r for r in rows if r["query_hash"] == top["query_hash"]]
    assert (
        top["requests"] == len(same) == max(sum(r["query_hash"] == f"q{k}" for r in rows) for k in range(6))
    )
    assert top["hits"] == hits(same)
    rule = {x["rule"]: x for x in s["rules"]}["trailing_whitespace"]
    for side, fired in (("fired", True), ("not_fired", False)):
        mine = [r for r in rows if ("trailing_whitespace" in r["rules_fired"]) == fired]
        assert rule[side]["requests"] == len(mine)
        assert rule[side]["hit_ratio"] == round(hits(mine) / len(mine), 4)
        back = [r for r in mine if r["cache_result"] in ("miss", "bypass")]
        ratio = sum(r["cached_tokens"] for r in back) / sum(r["prompt_tokens"] for r in back)
        assert rule[side]["prefix_cache_ratio"] == round(ratio, 4)


def test_report_folder_has_the_page_and_every_chart(log_db, tmp_path, capsys):
    url, *_ = log_db
    for fmt in ("html", "md"):
        out = tmp_path / fmt
        assert main_analyze(["--db", url, *RANGE, "--out", str(out), "--format", fmt]) == 0
        page = (out / f"report.{fmt}").read_text()
        for name in PNGS:
            data = (out / name).read_bytes()
            assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 2000, name
            assert name in page
        assert "correlation" in page
        summary = json.loads((out / "summary.json").read_text())
        assert summary["overall"]["requests"] == 40
    terminal = capsys.readouterr().out
    assert "By model" in terminal and "small-model" in terminal and "Threshold sweep" in terminal


def test_export_then_jsonl_gives_the_same_summary(log_db, tmp_path, capsys):
    url, rows, flagged, _ = log_db
    jsonl = tmp_path / "log.jsonl"
    assert main_export(["--db", url, *RANGE, "--out", str(jsonl)]) == 0
    lines = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert len(lines) == 40 and {x["id"] for x in lines if x["flagged"]} == flagged
    assert set(lines[0]) == {c.name for c in RequestRow.__table__.columns} | {"flagged"}
    from_db = analyze_json(["--db", url, *RANGE, "--out", str(tmp_path / "a")], capsys)
    from_file = analyze_json(["--jsonl", str(jsonl), *RANGE, "--out", str(tmp_path / "b")], capsys)
    for s in (from_db, from_file):
        del s["meta"]["source"], s["meta"]["generated_at"]
    assert from_db == from_file
    # Without a range a file is read whole: the same 40 rows.
    whole = analyze_json(["--jsonl", str(jsonl), "--out", str(tmp_path / "c")], capsys)
    assert whole["overall"] == from_file["overall"]


def test_export_to_stdout(log_db, capsys):
    url, *_ = log_db
    assert main_export(["--db", url, "--since", "all", "--out", "-"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 42


def fails(argv: list[str], capsys, code: int = 2) -> str:
    assert main_analyze(argv) == code
    captured = capsys.readouterr()
    assert "cachegw analyze: error: " in captured.err and "Traceback" not in captured.err
    return captured.err


def test_missing_database_is_reported_and_not_created(tmp_path, capsys):
    path = tmp_path / "nowhere" / "cachegw.db"
    assert "no database at" in fails(["--db", f"sqlite:///{path}"], capsys)
    assert "no database at" in fails(["--data-dir", str(tmp_path / "empty")], capsys)
    assert not path.parent.exists() and not (tmp_path / "empty").exists()
    assert main_export(["--db", f"sqlite:///{path}", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert not path.parent.exists() and not (tmp_path / "x.jsonl").exists()


def test_unreadable_databases(tmp_path, capsys):
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("create table t (x)")
    assert "no `requests` table" in fails(["--db", f"sqlite:///{other}"], capsys)
    junk = tmp_path / "junk.db"
    junk.write_text("not a database at all, just text " * 100)
    assert "cannot read the request log" in fails(["--db", f"sqlite:///{junk}"], capsys)
    assert "cannot open database" in fails(["--db", "nosuchdialect://u@h/db"], capsys)


def test_a_jsonl_line_with_an_unknown_cache_result_is_named(tmp_path, capsys):
    """Rows are typed records now: a result that is not one of the four is refused with its line."""
    bad = tmp_path / "odd.jsonl"
    bad.write_text(
        json.dumps(make_row(1, BASE)) + "\n" + json.dumps({**make_row(2, BASE), "cache_result": "hit"}) + "\n"
    )
    assert "line 2: column cache_result must be one of exact-hit, semantic-hit, miss, bypass" in fails(
        ["--jsonl", str(bad)], capsys
    )


def test_bad_jsonl(log_db, tmp_path, capsys):
    good = json.dumps(make_row(1, BASE))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good + "\n{not json\n")
    assert "line 2 is not JSON" in fails(["--jsonl", str(bad)], capsys)
    row = make_row(2, BASE)
    del row["ts"], row["model"]
    bad.write_text(good + "\n" + json.dumps(row) + "\n")
    assert "line 2: missing required columns ts, model" in fails(["--jsonl", str(bad)], capsys)
    bad.write_text(json.dumps({**make_row(3, BASE), "ts": "yesterday"}) + "\n")
    assert "column ts must be a number" in fails(["--jsonl", str(bad)], capsys)
    bad.write_text("[1, 2]\n")
    assert "expected a JSON object" in fails(["--jsonl", str(bad)], capsys)
    bad.write_text("\n")
    assert "is empty" in fails(["--jsonl", str(bad)], capsys)
    assert "cannot read" in fails(["--jsonl", str(tmp_path / "missing.jsonl")], capsys)


def test_empty_range_and_bad_times(log_db, capsys):
    url, *_ = log_db
    msg = fails(["--db", url, "--since", "2020-01-01", "--until", "2020-01-02"], capsys, code=1)
    assert "no requests in" in msg and "2020-01-01 00:00:00 UTC" in msg
    assert "--since 'yesterday'" in fails(["--db", url, "--since", "yesterday"], capsys)
    assert "must come before" in fails(
        ["--db", url, "--since", "2025-03-02", "--until", "2025-03-01"], capsys
    )


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "cachegw.gateway.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_cli_subprocess_errors_have_no_traceback(log_db, tmp_path):
    url, *_ = log_db
    missing = tmp_path / "none" / "cachegw.db"
    p = run_cli("analyze", "--db", f"sqlite:///{missing}", "--out", str(tmp_path / "r"))
    assert p.returncode == 2 and "no database at" in p.stderr and "Traceback" not in p.stderr
    assert not missing.parent.exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "ts": BASE}) + "\n")
    p = run_cli("analyze", "--jsonl", str(bad), "--out", str(tmp_path / "r"))
    assert p.returncode == 2 and "missing required columns tenant, model, cache_result" in p.stderr
    assert "Traceback" not in p.stderr
    p = run_cli("analyze", "--db", url, "--since", "tomorrow-ish")
    assert p.returncode == 2 and "--since" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("export", "--db", url, "--since", "2020-01-01", "--until", "2020-01-02", "--out", "-")
    assert p.returncode == 0 and p.stdout == "" and "Traceback" not in p.stderr


def test_reports_land_out_of_git_by_default(log_db, capsys):
    """Without --out the report goes to <data dir>/report (./data/report from the repo root, which git
    ignores, as it ignores a ./cachegw-report of older habits); the shipped artifacts stay tracked."""
    *_, data_dir = log_db
    assert main_analyze(["--data-dir", str(data_dir), *RANGE, "--format", "md"]) == 0
    assert (data_dir / "report" / "report.md").is_file() and (data_dir / "report" / "summary.json").is_file()
    capsys.readouterr()
    written = [
        "data/report/report.md",
        "cachegw-report/report.html",
        "docs/cachegw-report/a.png",
        "verifier.npz",
    ]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *written, "policies/artifacts/verifier.npz"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert ignored.stdout.split() == written
