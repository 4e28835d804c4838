"""Admin queries are bounded: a window or bucket beyond the caps is a 400, and the largest allowed
stats query runs off the event loop, so other callers (here /health) are answered while it runs."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_admin import admin_settings, api
from tests.test_gateway import backend_url, gateway  # noqa: F401

YEAR = 366 * 86400
ROWS = 60_000


@pytest.fixture(scope="module")
def gw(backend_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # noqa: F811
    data_dir: Path = tmp_path_factory.mktemp("bounds")
    with gateway(admin_settings(data_dir, backend_url)) as url:
        now = time.time()
        rows = [
            (f"r{i}", now - (i * YEAR / ROWS), "t", "m", "chat", 0, "miss" if i % 3 else "semantic-hit")
            + (0.9, 0.88, None, "", 5.0, 1.0, 100.0, None, 80.0, 100, 10, 0, 200)
            for i in range(ROWS)
        ]
        with sqlite3.connect(data_dir / "cachegw.db") as db:
            db.executemany(
                "INSERT INTO requests (id, ts, tenant, model, endpoint, stream, cache_result, similarity,"
                " threshold, entry_id, rules_fired, embed_ms, lookup_ms, backend_ms, backend, total_ms,"
                " prompt_tokens, completion_tokens, cached_tokens, status)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                rows,
            )
        yield url


@pytest.mark.parametrize(
    "query,param",
    [
        ("window=100000d&bucket=100000w", "window"),
        ("window=367d", "window"),
        ("window=1h&bucket=100000w", "bucket"),
        ("window=366d&bucket=10m", "bucket"),  # 52,704 points
    ],
)
def test_oversize_windows_and_buckets_are_a_400_naming_the_parameter(gw: str, query: str, param: str) -> None:
    r = api(gw, "GET", f"/stats?{query}")
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_whatif_windows_are_capped_too(gw: str) -> None:
    r = api(gw, "GET", "/whatif?threshold=0.9&window=100000d")
    assert r.status_code == 400 and r.json()["error"]["param"] == "window"


def test_health_is_answered_while_the_largest_allowed_stats_query_runs(gw: str) -> None:
    done: list[float] = []
    results: list[httpx.Response] = []

    def big_query() -> None:
        results.append(api(gw, "GET", "/stats?window=366d&bucket=1h"))
        done.append(time.monotonic())

    workers = [threading.Thread(target=big_query) for _ in range(3)]
    for w in workers:
        w.start()
    answered_during: list[float] = []
    while any(w.is_alive() for w in workers):
        r = httpx.get(f"{gw}/health", timeout=60)
        assert r.status_code == 200
        if not done:  # no stats query had finished when this health answer came back
            answered_during.append(time.monotonic())
    for w in workers:
        w.join()
    assert all(r.status_code == 200 for r in results)
    body = results[0].json()
    assert len(body["timeseries"]["points"]) == 8784 and body["overall"]["requests"] == ROWS
    assert answered_during, "health was not answered while the stats queries ran"


def test_the_aggregations_never_run_on_the_event_loop(gw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deterministic half of the test above: every stats aggregation runs in a worker thread."""
    import asyncio

    from cachegw.gateway.storage import stats

    on_loop: list[bool] = []
    real_timeseries, real_sweep = stats.timeseries, stats.threshold_sweep

    def timeseries(*a, **kw):
        on_loop.append(asyncio._get_running_loop() is not None)
        return real_timeseries(*a, **kw)

    def sweep(*a, **kw):
        on_loop.append(asyncio._get_running_loop() is not None)
        return real_sweep(*a, **kw)

    monkeypatch.setattr(stats, "timeseries", timeseries)
    monkeypatch.setattr(stats, "threshold_sweep", sweep)
    assert api(gw, "GET", "/stats?window=30d").status_code == 200
    assert api(gw, "GET", "/whatif?threshold=0.9&window=30d").status_code == 200
    assert len(on_loop) == 4 and not any(on_loop)
