"""Every response says why the cache did what it did (x-cache-reason), and the request log keeps it.

The real gateway in front of the real engine (the session's shared backend), the openai SDK.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_gateway import MODEL, ask, backend_url, chat, gateway, settings_for  # noqa: F401

ADMIN_TOKEN = "cgw-reasons-admin-token"


@pytest.fixture(scope="module")
def gw(backend_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:  # noqa: F811
    data_dir = tmp_path_factory.mktemp("reasons")
    s = settings_for(data_dir, [backend_url])
    s = s.model_copy(update={"admin": s.admin.model_copy(update={"token": ADMIN_TOKEN})})
    with gateway(s) as url:
        yield url, data_dir


def logged_reason(data_dir: Path, request_id: str) -> str | None:
    deadline = time.monotonic() + 10
    while True:
        with sqlite3.connect(data_dir / "cachegw.db") as db:
            row = db.execute("SELECT reason FROM requests WHERE id = ?", (request_id,)).fetchone()
        if row or time.monotonic() > deadline:
            return row[0] if row else "not logged"
        time.sleep(0.1)


def test_misses_and_hits_say_why(gw: tuple[str, Path]) -> None:
    url, data_dir = gw
    _, first, _ = chat(url, ask("What is the capital of France?"))
    assert (first["x-cache"], first["x-cache-reason"]) == ("miss", "no-candidate")
    _, exact, _ = chat(url, ask("What is the capital of France?"))
    assert (exact["x-cache"], exact["x-cache-reason"]) == ("exact-hit", "exact")
    _, para, _ = chat(url, ask("what's the capital of france"))
    assert (para["x-cache"], para["x-cache-reason"]) == ("semantic-hit", "semantic")
    _, other, _ = chat(url, ask("How do I bake sourdough bread at home?"))
    assert (other["x-cache"], other["x-cache-reason"]) == ("miss", "below-threshold")
    _, limited, _ = chat(url, ask("What is the capital of France?"), max_tokens=1)
    assert limited["x-cache"] == "miss" and limited["x-cache-reason"] == "too-long"  # for max_tokens 1
    for h in (first, exact, para, other, limited):
        assert logged_reason(data_dir, h["x-request-id"]) == h["x-cache-reason"]


@pytest.mark.parametrize(
    "extra,headers,reason",
    [
        ({}, {}, "temperature"),  # temperature left unset: OpenAI's default 1.0 samples
        ({"temperature": 0}, {"cache-control": "no-store"}, "no-store"),
        ({"temperature": 0}, {"cache-control": "no-cache"}, "no-cache"),
        ({"temperature": 0, "n": 2}, {}, "n>1"),
        ({"temperature": 0, "logprobs": True}, {}, "logprobs"),
    ],
)
def test_a_bypass_names_its_cacheability_row(
    gw: tuple[str, Path], extra: dict, headers: dict, reason: str
) -> None:
    url, data_dir = gw
    body = {"model": MODEL, "messages": ask("Name a planet."), "max_tokens": 4, **extra}
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        headers={"authorization": "Bearer tenant-a", **headers},
        timeout=120,
    )
    assert r.headers["x-cache"] == "bypass" and r.headers["x-cache-reason"] == reason
    if reason != "no-store":
        assert logged_reason(data_dir, r.headers["x-request-id"]) == reason


def sql_reason_counts(data_dir: Path, sep: str) -> dict[str, int]:
    """ "result<sep>reason" -> requests, counted by SQL straight from the request log."""
    with sqlite3.connect(data_dir / "cachegw.db") as db:
        rows = db.execute(
            f"SELECT cache_result || '{sep}' || reason, count(*) FROM requests"
            " WHERE cache_result IN ('miss', 'bypass') GROUP BY 1"
        ).fetchall()
    return dict(rows)


def test_analyze_counts_the_same_reasons_as_the_log(gw: tuple[str, Path]) -> None:
    from cachegw.gateway.config import load_settings
    from cachegw.gateway.offline.analyze_summary import build_summary
    from cachegw.gateway.storage.request_log import read_database

    url, data_dir = gw
    _, h, _ = chat(url, ask("Which ocean is the largest?"), temperature=None)  # unset: a bypass
    logged_reason(data_dir, h["x-request-id"])
    want = sql_reason_counts(data_dir, "/")
    log = read_database(f"sqlite:///{data_dir / 'cachegw.db'}", None, None)
    got = {
        f"{r['result']}/{r['reason']}": r["requests"]
        for r in build_summary(log, load_settings(None))["reasons"]
    }
    assert got == want and want.get("bypass/temperature", 0) >= 1


def test_admin_stats_count_the_same_reasons_as_the_log(gw: tuple[str, Path]) -> None:
    """/admin/api/stats (the dashboard's table) agrees with a SQL count, overall and bucket by bucket."""
    url, data_dir = gw
    _, h, _ = chat(url, ask("Name a prime number above ten."), temperature=None)
    logged_reason(data_dir, h["x-request-id"])
    want = sql_reason_counts(data_dir, ":")
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    stats = httpx.get(f"{url}/admin/api/stats", params={"window": "1h"}, headers=auth, timeout=30).json()
    got = {f"{r['result']}:{r['reason']}": r["requests"] for r in stats["reasons"]}
    per_bucket: dict[str, int] = {}
    for point in stats["timeseries"]["points"]:
        for key, n in point["reasons"].items():
            per_bucket[key] = per_bucket.get(key, 0) + n
    assert got == want == per_bucket and want.get("bypass:temperature", 0) >= 1
    assert abs(sum(r["share"] for r in stats["reasons"]) - 1) < 1e-9
