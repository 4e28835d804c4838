"""/metrics behind ``[gateway] metrics_token`` (issue 13: it told anyone the request counts and the
cache size). The real gateway on loopback, real HTTP; the separate listener is tested as a process in
tests/test_gateway_process.py."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.test_admin import TOKEN, admin_settings
from tests.test_gateway import ask, backend_url, chat, gateway  # noqa: F401

METRICS_TOKEN = "scrape-token-0123456789"


@pytest.fixture(scope="module")
def gw(backend_url, tmp_path_factory) -> Iterator[str]:  # noqa: F811
    s = admin_settings(tmp_path_factory.mktemp("metrics"), backend_url)
    s = s.model_copy(update={"gateway": s.gateway.model_copy(update={"metrics_token": METRICS_TOKEN})})
    with gateway(s) as url:
        yield url


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong", "Bearer tenant-a", f"Bearer {TOKEN}", f"Basic {METRICS_TOKEN}", "Bearer"],
    ids=["missing", "wrong", "tenant-key", "admin-token", "not-bearer", "empty"],
)
def test_metrics_need_the_metrics_token(gw, authorization):
    headers = {"authorization": authorization} if authorization else {}
    r = httpx.get(f"{gw}/metrics", headers=headers, timeout=30)
    assert r.status_code == 401
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "metrics_unauthorized"
    assert "cachegw_gateway" not in r.text and METRICS_TOKEN not in r.text


def test_metrics_with_the_token_count_requests(gw):
    chat(gw, ask("Name a color of the sky."))
    r = httpx.get(f"{gw}/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'cachegw_gateway_requests_total{result="miss"}' in r.text
    # the 401s above were counted as errors, like any other
    assert 'cachegw_gateway_errors_total{code="metrics_unauthorized",status="401"}' in r.text
