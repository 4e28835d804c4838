"""``[gateway] request_log_commit = "per_request"``: a client that has its response has its row in
the request log (issue 13: batched rows were lost on kill -9). The real gateway and engine, real
SQLite read from outside the gateway the moment each response is complete; with "batched" the rows
arrive up to 0.2 s later and this test fails. The kill -9 case is in tests/test_gateway_process.py."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_gateway import MODEL, ask, backend_url, chat, client, gateway, settings_for  # noqa: F401


@pytest.fixture(scope="module")
def gw(backend_url, tmp_path_factory) -> Iterator[tuple[str, Path]]:  # noqa: F811
    data = tmp_path_factory.mktemp("per-request")
    s = settings_for(data, [backend_url])
    s = s.model_copy(update={"gateway": s.gateway.model_copy(update={"request_log_commit": "per_request"})})
    with gateway(s) as url:
        yield url, data / "cachegw.db"


def logged(db: Path, request_id: str) -> tuple | None:
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT cache_result, status FROM requests WHERE id = ?", (request_id,)
        ).fetchone()


def test_json_miss_and_hit_are_in_the_log_when_the_client_has_them(gw):
    url, db = gw
    for expected in ("miss", "exact-hit"):
        _, h, _ = chat(url, ask("Name a month of the year."))
        assert h["x-cache"] == expected and logged(db, h["x-request-id"]) == (expected, 200)


def test_a_stream_is_in_the_log_when_its_last_event_arrives(gw):
    url, db = gw
    for expected in ("miss", "exact-hit"):
        raw = client(url).chat.completions.with_raw_response.create(
            model=MODEL, messages=ask("Name a day of the week."), temperature=0, max_tokens=16, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        assert text and raw.headers["x-cache"] == expected
        assert logged(db, raw.headers["x-request-id"]) == (expected, 200)


def test_a_failed_request_is_in_the_log_too(gw):
    url, db = gw
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"authorization": "Bearer tenant-a"},
        json={"model": MODEL, "messages": ask("Hi"), "temperature": 0, "max_tokens": 10**6},
        timeout=60,
    )
    assert r.status_code == 400  # the engine refuses it: the backend's error, passed through
    assert logged(db, r.headers["x-request-id"]) == ("miss", 400)
