"""Tenants share fairly: a client's `priority` reaches the backend as sent, within the range the operator
grants its tenant; requests and backend tokens a minute are limited per tenant, counted across replicas
in the database, and answered beyond the budget with 429 and Retry-After.

A small recording upstream stands in for the backend: the tests read the headers and bodies it received
and the usage it reports (6 tokens an answer), which the built-in engine cannot pin down."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cachegw.gateway.api.app import build_app
from cachegw.gateway.compose import started_gateway
from cachegw.gateway.config import Settings, load_settings
from testkit.servers import Upstream, recording_upstream, serve_in_thread
from tests.test_gateway import MovableClock
from tests.test_shared_store import shared_url  # noqa: F401  (SQLite and PostgreSQL)

MODEL = "test-model"


@pytest.fixture
def upstream() -> Iterator[tuple[Upstream, str]]:
    up = Upstream(MODEL)
    with serve_in_thread(recording_upstream(up)) as url:
        yield up, f"{url}/v1"


def settings(data: Path, backend: str, database_url: str = "", **tenants) -> Settings:
    s = load_settings(None, data_dir=str(data), backends=(backend,))
    gateway = s.gateway.model_copy(update={"database_url": database_url}) if database_url else s.gateway
    validated = type(s.tenants).model_validate({**s.tenants.model_dump(), **tenants})
    return s.model_copy(update={"tenants": validated, "gateway": gateway})


@contextlib.contextmanager
def gateway(s: Settings, clock=None) -> Iterator[str]:
    kw = {"clock": clock} if clock is not None else {}
    with serve_in_thread(build_app(lambda: started_gateway(s, progress=False, **kw)), lifespan="on") as url:
        yield url


def ask(url: str, key: str, text: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0, **extra}
    return httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


def test_priority_reaches_the_backend_within_the_granted_range(upstream, tmp_path) -> None:
    from cachegw.gateway.request.tenants import key_hash

    up, url = upstream
    s = settings(tmp_path, url, priority_ranges={key_hash("batch"): (1, 1000), key_hash("vip"): (-50, 0)})
    with gateway(s) as gw:
        r = ask(gw, "anyone", "hello", priority=-5)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert r.json()["error"]["code"] == "priority_not_allowed"
        assert ask(gw, "anyone", "hello", priority=0).status_code == 200
        assert ask(gw, "vip", "first", priority=-50).status_code == 200
        assert ask(gw, "batch", "later", priority=900).status_code == 200
        assert ask(gw, "batch", "ahead?", priority=0).status_code == 400
        sent = [json.loads(body).get("priority") for _, _, _, body in up.requests("/v1/chat/completions")]
        assert sent == [0, -50, 900]  # as sent, nothing clamped or dropped


def test_request_limits_are_counted_across_replicas(upstream, tmp_path, shared_url) -> None:  # noqa: F811
    """Two gateways on one database share one budget: the fourth request a minute is refused by
    whichever replica gets it, and the next minute is a fresh window."""
    up, url = upstream
    db = shared_url
    limits = {"*": {"requests_per_minute": 3}}
    clock = MovableClock()
    a = settings(tmp_path / "a", url, db, rate_limits=limits)
    b = settings(tmp_path / "b", url, db, rate_limits=limits)
    with gateway(a, clock) as gw_a, gateway(b, clock) as gw_b:
        codes = [ask(gw, "t1", f"q{i}").status_code for i, gw in enumerate([gw_a, gw_b, gw_a])]
        assert codes == [200, 200, 200]
        refused = ask(gw_b, "t1", "q3")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert ask(gw_a, "t2", "another tenant").status_code == 200  # budgets are per tenant
        clock.advance(60)
        assert ask(gw_a, "t1", "next minute").status_code == 200


def test_token_limits_count_backend_tokens_only(upstream, tmp_path) -> None:
    up, url = upstream
    clock = MovableClock()
    s = settings(tmp_path, url, rate_limits={"*": {"tokens_per_minute": 10}})
    with gateway(s, clock) as gw:
        assert ask(gw, "t", "one").status_code == 200  # 6 tokens
        assert ask(gw, "t", "one").headers["x-cache"] == "exact-hit"  # a hit spends none
        assert ask(gw, "t", "two").status_code == 200  # 12 now: over the budget
        refused = ask(gw, "t", "three")
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"
        clock.advance(60)
        assert ask(gw, "t", "three").status_code == 200


def test_bad_ranges_are_refused_at_start() -> None:
    s = load_settings(None)
    with pytest.raises(ValueError, match="priority range"):
        s.tenants.model_validate({**s.tenants.model_dump(), "priority_range": (5, 1)})
