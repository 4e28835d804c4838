"""The admin API end to end: the real gateway in front of the real engine, real HTTP, the openai SDK.

Each admin operation is checked by what the next request does, not only by what the API answers.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from cachegw.gateway.storage.request_record import RequestRecord
from tests.test_gateway import MODEL, MovableClock, ask, backend_url, chat, gateway, settings_for  # noqa: F401
from tests.test_recorder import row as log_row

TOKEN = "test-admin-token-1234567890"


def admin_settings(data_dir, backend: str, token: str = TOKEN, **cache_over):
    s = settings_for(data_dir, [backend], **cache_over)
    return s.model_copy(update={"admin": s.admin.model_copy(update={"token": token})})


def api(url: str, method: str, path: str, token: str | None = TOKEN, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, f"{url}/admin/api{path}", headers=headers, timeout=60, **kw)


def flagged_by_tenant(url: str, request_id: str, key: str = "tenant-a") -> httpx.Response:
    return httpx.post(
        f"{url}/v1/cache/feedback",
        headers={"authorization": f"Bearer {key}"},
        json={"request_id": request_id, "verdict": "bad"},
        timeout=60,
    )


def wait_logged(url: str, n: int) -> dict:
    """Stats once the request log holds ``n`` requests (it is written in batches every 0.2 s)."""
    deadline = time.monotonic() + 10
    while True:
        overall = api(url, "GET", "/stats?window=1h").json()["overall"]
        if overall["requests"] >= n or time.monotonic() > deadline:
            return overall
        time.sleep(0.1)


CLOCK = MovableClock()  # the module gateway's wall clock: TTL tests move it instead of sleeping


@pytest.fixture(scope="module")
def gw(backend_url, tmp_path_factory) -> Iterator[str]:  # noqa: F811
    with gateway(admin_settings(tmp_path_factory.mktemp("admin"), backend_url), CLOCK) as url:
        yield url


# Authentication


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token", "Bearer tenant-a", f"Basic {TOKEN}", "Bearer"],
    ids=["missing", "wrong", "tenant-key", "not-bearer", "empty"],
)
@pytest.mark.parametrize(
    "method,path",
    [("GET", "/settings"), ("PUT", "/settings"), ("GET", "/stats"), ("POST", "/flush"), ("GET", "/audit")],
)
def test_admin_api_refuses_anything_but_the_admin_token(gw, authorization, method, path):
    headers = {"authorization": authorization} if authorization else {}
    r = httpx.request(method, f"{gw}/admin/api{path}", headers=headers, json={}, timeout=30)
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "admin_unauthorized" and TOKEN not in r.text


def test_tenant_keys_never_open_the_admin_api_in_keys_mode(backend_url, tmp_path):  # noqa: F811
    s = admin_settings(tmp_path, backend_url)
    s = s.model_copy(
        update={"tenants": s.tenants.model_copy(update={"mode": "keys", "keys": {"acme": "k-1"}})}
    )
    with gateway(s) as url:
        assert api(url, "GET", "/settings", token="k-1").status_code == 401
        assert api(url, "GET", "/settings").status_code == 200


def test_generated_token_is_owner_only_reused_and_env_overrides(backend_url, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.delenv("CACHEGW_ADMIN_TOKEN", raising=False)
    s = admin_settings(tmp_path, backend_url, token="")
    with gateway(s) as url:
        path = tmp_path / "admin_token"
        token = path.read_text().strip()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(token) > 30
        assert api(url, "GET", "/settings", token=token).status_code == 200
    with gateway(s) as url:  # a restart keeps the generated token
        assert path.read_text().strip() == token
        assert api(url, "GET", "/settings", token=token).status_code == 200
    monkeypatch.setenv("CACHEGW_ADMIN_TOKEN", "from-the-environment")
    with gateway(s) as url:
        assert api(url, "GET", "/settings", token="from-the-environment").status_code == 200
        assert api(url, "GET", "/settings", token=token).status_code == 401


def test_admin_api_is_in_the_openapi_schema(gw):
    paths = httpx.get(f"{gw}/openapi.json").json()["paths"]
    for p in ("/admin/api/settings", "/admin/api/stats", "/admin/api/entries", "/admin/api/flush"):
        assert p in paths
    assert "/admin/api/entries/{entry_id}" in paths and "/admin/api/audit" in paths


# Settings change what the next request does


def test_lowered_threshold_makes_a_paraphrase_hit(backend_url, tmp_path):  # noqa: F811
    with gateway(admin_settings(tmp_path, backend_url)) as url:
        t1, h1, _ = chat(url, ask("What is the boiling point of water?"))
        assert h1["x-cache"] == "miss"
        r = api(
            url, "PUT", "/settings", json={"thresholds": {"default": 0.8}, "verifier": {"threshold": 0.5}}
        )
        assert r.status_code == 200 and r.json()["thresholds"]["default"] == 0.8
        t2, h2, _ = chat(url, ask("At what temperature does water boil?"))
        assert h2["x-cache"] == "semantic-hit" and t2 == t1
        # it would have missed at the default threshold
        assert 0.8 <= float(h2["x-cache-similarity"]) < 0.88


def test_model_threshold_overrides_default_and_null_removes_it(gw):
    r = api(gw, "PUT", "/settings", json={"thresholds": {"models": {MODEL: 0.99, "other": 0.5}}})
    assert r.json()["thresholds"]["models"] == {MODEL: 0.99, "other": 0.5}
    chat(gw, ask("Give me a synonym for happy."))
    _, h, _ = chat(gw, ask("What is another word for happy?"))  # similarity 0.92 < 0.99
    assert h["x-cache"] == "miss"
    r = api(gw, "PUT", "/settings", json={"thresholds": {"models": {MODEL: None}}})
    assert r.json()["thresholds"]["models"] == {"other": 0.5}


def test_canonicalization_rule_switched_off_applies_to_the_next_request(gw):
    chat(gw, ask("Name a primary color please."))
    _, h, _ = chat(gw, ask("Name a primary color please.   "))
    assert h["x-cache"] == "exact-hit"
    api(gw, "PUT", "/settings", json={"canonicalization": {"trailing_whitespace": False}})
    try:
        _, h, _ = chat(gw, ask("Name a primary color please.     "))
        assert h["x-cache"] != "exact-hit"
    finally:
        api(gw, "PUT", "/settings", json={"canonicalization": {"trailing_whitespace": True}})


def test_ttl_setting_applies_to_new_entries(gw):
    api(gw, "PUT", "/settings", json={"ttl_seconds": 60})
    try:
        chat(gw, ask("Name a fruit that is yellow."))
        assert chat(gw, ask("Name a fruit that is yellow."))[1]["x-cache"] == "exact-hit"
        CLOCK.advance(61)
        _, h, _ = chat(gw, ask("Name a fruit that is yellow."))
        assert h["x-cache"] == "miss"  # expired after the new TTL
    finally:
        api(gw, "PUT", "/settings", json={"ttl_seconds": 604800})


@pytest.mark.parametrize(
    "body,param",
    [
        ({"thresholds": {"default": 1.5}}, "thresholds.default"),
        ({"thresholds": {"default": -0.1}}, "thresholds.default"),
        ({"thresholds": {"tenants": {"x": 2}}}, "thresholds.tenants.x"),
        ({"thresholds": {"default": "high"}}, "thresholds.default"),
        ({"eviction": {"policy": "fifo"}}, "eviction.policy"),
        ({"ttl_seconds": 0}, "ttl_seconds"),
        ({"canonicalization": {"no_such_rule": True}}, "canonicalization.no_such_rule.[key]"),
        ({"threshold": 0.5}, "threshold"),
        # strict types, as on /v1: these were coerced (issue 13)
        ({"verifier": {"enabled": "on"}}, "verifier.enabled"),
        ({"thresholds": {"default": "0.5"}}, "thresholds.default"),
        ({"ttl_seconds": "100"}, "ttl_seconds"),
        ({"eviction": {"max_entries": "100"}}, "eviction.max_entries"),
        ({"eviction": {"max_bytes": 1.0e6}}, "eviction.max_bytes"),
        ({"cache": {"exact": 1}}, "cache.exact"),
        ({"canonicalization": {"sort_tools": "false"}}, "canonicalization.sort_tools"),
        ({"thresholds": {"models": {"m": "0.9"}}}, "thresholds.models.m"),
    ],
)
def test_invalid_settings_are_a_400_and_change_nothing(gw, body, param):
    before = api(gw, "GET", "/settings").json()
    r = api(gw, "PUT", "/settings", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert api(gw, "GET", "/settings").json() == before


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'"text"'])
def test_settings_body_must_be_a_json_object(gw, raw):
    r = api(gw, "PUT", "/settings", content=raw)
    assert r.status_code == 400 and "error" in r.json()


def test_changes_are_audited_with_who_old_and_new(gw):
    api(gw, "PUT", "/settings", json={"eviction": {"policy": "lfu"}})
    r = httpx.put(
        f"{gw}/admin/api/settings",
        headers={"authorization": f"Bearer {TOKEN}", "x-admin-user": "alice"},
        json={"eviction": {"policy": "lru"}},
    )
    assert r.status_code == 200
    event = api(gw, "GET", "/audit?limit=1").json()["data"][0]
    assert event["actor"] == "alice@127.0.0.1" and event["action"] == "settings.update"
    assert event["old"] == {"eviction.policy": "lfu"} and event["new"] == {"eviction.policy": "lru"}
    assert abs(event["ts"] - time.time()) < 30


# Entries


def test_deleted_entry_misses_and_flush_empties_the_cache(gw):
    chat(gw, ask("What is the largest planet?"))
    found = api(gw, "GET", "/entries", params={"query": "largest planet"}).json()
    assert found["total"] == 1
    entry = found["data"][0]
    assert entry["query"] == "What is the largest planet?" and entry["answer"]
    assert api(gw, "GET", f"/entries/{entry['id']}").json()["response"]["choices"]
    assert api(gw, "DELETE", f"/entries/{entry['id']}").json() == {"deleted": 1}
    assert api(gw, "DELETE", f"/entries/{entry['id']}").status_code == 404
    _, h, _ = chat(gw, ask("What is the largest planet?"))
    assert h["x-cache"] == "miss"
    assert api(gw, "DELETE", "/entries").status_code == 400  # a bulk delete needs a filter
    assert api(gw, "DELETE", "/entries", params={"model": MODEL}).json()["deleted"] >= 1
    chat(gw, ask("What is the largest planet?"))
    assert api(gw, "POST", "/flush").json()["deleted"] >= 1
    assert api(gw, "GET", "/entries").json()["total"] == 0
    _, h, _ = chat(gw, ask("What is the largest planet?"))
    assert h["x-cache"] == "miss"


@pytest.mark.parametrize(
    "path,param",
    [
        ("/stats?window=forever", "window"),
        ("/stats?window=0h", "window"),
        ("/stats?window=1h&bucket=0.1s", "bucket"),
        ("/whatif?threshold=2", "threshold"),
        ("/whatif", "threshold"),
        ("/entries?order=random", "order"),
        ("/entries?limit=0", "limit"),
        ("/entries/abc", "entry_id"),
    ],
)
def test_bad_query_parameters_are_a_400_naming_the_parameter(gw, path, param):
    r = api(gw, "GET", path)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


# Feedback


def test_flagged_exact_hit_is_never_served_again(gw):
    _, h1, _ = chat(gw, ask("Name a color of the rainbow."))
    _, h2, _ = chat(gw, ask("Name a color of the rainbow."))
    assert h2["x-cache"] == "exact-hit"
    r = flagged_by_tenant(gw, h2["x-request-id"])
    assert r.status_code == 200 and "never served again" in r.json()["action"]
    _, h3, _ = chat(gw, ask("Name a color of the rainbow."))
    assert h3["x-cache"] == "miss"
    flagged = api(gw, "GET", "/feedback").json()["data"][0]
    entry = api(gw, "GET", f"/entries/{h2['x-cache-entry']}").json()  # the admin API reads the opaque id
    assert flagged["request_id"] == h2["x-request-id"] and flagged["entry_id"] == entry["id"]


def test_flagged_semantic_hit_raises_the_entry_threshold(gw):
    t1, _, _ = chat(gw, ask("How many legs does a spider have?"))
    c = openai.OpenAI(base_url=f"{gw}/v1", api_key="tenant-a", max_retries=0)
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=ask("How many legs do spiders have?"), temperature=0, max_tokens=24
    )
    completion = raw.parse()
    assert raw.headers["x-cache"] == "semantic-hit"
    sim = float(raw.headers["x-cache-similarity"])
    # the response body's id names the request too
    r = flagged_by_tenant(gw, completion.id)
    assert r.status_code == 200 and r.json()["similarity"] == pytest.approx(sim, abs=1e-4)
    entry = api(gw, "GET", f"/entries/{raw.headers['x-cache-entry']}").json()
    assert entry["threshold"] == pytest.approx(sim + 0.02, abs=1e-4) and not entry["bad"]
    # the same paraphrase no longer hits; the entry's own query still does
    _, h, _ = chat(gw, ask("How many legs do spiders have?"))
    assert h["x-cache"] == "miss"
    t3, h3, _ = chat(gw, ask("How many legs does a spider have?"))
    assert h3["x-cache"] == "exact-hit" and t3 == t1


def test_a_tenant_cannot_flag_another_tenants_request(gw):
    chat(gw, ask("Name a musical instrument."))
    _, h, _ = chat(gw, ask("Name a musical instrument."))
    r = flagged_by_tenant(gw, h["x-request-id"], key="tenant-b")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    _, h2, _ = chat(gw, ask("Name a musical instrument."))
    assert h2["x-cache"] == "exact-hit"  # nothing was flagged


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"request_id": "req-unknown", "verdict": "bad"}, 404, "request_id"),
        ({"request_id": "x", "verdict": "good"}, 400, "verdict"),
        ({"verdict": "bad"}, 400, "request_id"),
        ({"request_id": 12, "verdict": "bad"}, 400, "request_id"),
        ([1], 400, None),
        ({"request_id": "", "verdict": "bad"}, 400, "request_id"),
        ({"request_id": "x", "verdict": "bad", "comment": "wrong"}, 400, "comment"),  # unknown field
        ({"entry_id": 5, "verdict": "bad"}, 400, "entry_id"),  # a tenant names entries by x-cache-entry
        ({"entry_id": "ce-" + "A" * 22, "verdict": "bad"}, 404, "entry_id"),  # never shown to it
    ],
)
def test_feedback_bad_input(gw, body, status, param):
    r = httpx.post(f"{gw}/v1/cache/feedback", headers={"authorization": "Bearer tenant-a"}, json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "body,param",
    [
        ({"entry_id": "100", "verdict": "bad"}, "entry_id"),  # a string is not an integer id
        ({"entry_id": True, "verdict": "bad"}, "entry_id"),
        ({"entry_id": 1.0, "verdict": "bad"}, "entry_id"),
        ({"entry_id": 1, "verdict": ["bad"]}, "verdict"),
        ({"entry_id": 1}, "verdict"),
    ],
)
def test_admin_feedback_types_are_strict(gw, body, param):
    r = api(gw, "POST", "/feedback", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_feedback_on_a_bypass_is_a_409(gw):
    _, h, _ = chat(gw, ask("Say hello."), extra_headers={"cache-control": "no-store"})
    assert h["x-cache"] == "bypass"
    r = flagged_by_tenant(gw, h["x-request-id"])
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_cached"


def test_admin_flags_an_entry_directly(gw):
    chat(gw, ask("Name a type of tree."))
    entry = api(gw, "GET", "/entries", params={"query": "type of tree"}).json()["data"][0]
    r = api(gw, "POST", "/feedback", json={"entry_id": entry["id"], "verdict": "bad"})
    assert r.status_code == 200 and r.json()["actor"] == "admin@127.0.0.1"
    _, h, _ = chat(gw, ask("Name a type of tree."))
    assert h["x-cache"] == "miss"
    assert api(gw, "POST", "/feedback", json={"entry_id": 10**9, "verdict": "bad"}).status_code == 404


# Statistics


def test_stats_count_what_was_sent(backend_url, tmp_path):  # noqa: F811
    with gateway(admin_settings(tmp_path, backend_url)) as url:
        chat(url, ask("What is the capital of Italy?"))
        chat(url, ask("What is the capital of Italy?"))
        chat(url, ask("Name a large ocean."))
        chat(url, ask("Tell me the name of a big ocean."))
        chat(url, ask("Count to three."), extra_headers={"cache-control": "no-cache"})
        o = wait_logged(url, 5)
        assert (o["requests"], o["exact_hits"], o["semantic_hits"], o["misses"], o["bypasses"]) == (
            5,
            1,
            1,
            2,
            1,
        )
        assert o["hit_ratio"] == 0.4 and o["tokens_saved"] > 0 and o["cost_saved_usd"] > 0
        assert (
            o["latency_ms"]["hit"]["n"] == 2
            and o["latency_ms"]["miss"]["p50"] > o["latency_ms"]["hit"]["p50"]
        )
        s = api(url, "GET", "/stats?window=1h").json()
        assert list(s["by_model"]) == [MODEL] and s["by_model"][MODEL]["requests"] == 5
        assert sum(p["requests"] for p in s["timeseries"]["points"]) == 5
        assert sum(p["requests"] for p in s["per_hour"]) == 5
        sim = s["similarity"]
        assert sum(sim["hits"]) == 1 and sum(sim["misses"]) >= 1 and sim["threshold"] == 0.88
        w = api(url, "GET", "/whatif?threshold=0.5").json()
        assert w["current"]["threshold"] == 0.88 and w["proposed"]["candidates"] >= w["current"]["candidates"]
        assert len(w["curve"]) == 51


def test_settings_and_learned_thresholds_survive_a_restart(backend_url, tmp_path):  # noqa: F811
    s = admin_settings(tmp_path, backend_url)
    with gateway(s) as url:
        api(url, "PUT", "/settings", json={"thresholds": {"default": 0.9, "tenants": {"vip": 0.95}}})
        chat(url, ask("How do I learn Python quickly?"))
        _, h, _ = chat(url, ask("What is the fastest way to learn Python?"))
        assert h["x-cache"] == "semantic-hit"
        assert flagged_by_tenant(url, h["x-request-id"]).status_code == 200
    with gateway(s) as url:
        got = api(url, "GET", "/settings").json()
        assert got["thresholds"]["default"] == 0.9 and got["thresholds"]["tenants"] == {"vip": 0.95}
        _, h, _ = chat(url, ask("What is the fastest way to learn Python?"))
        assert h["x-cache"] == "miss"  # the learned entry threshold came back from the database
        assert any(e["action"] == "feedback.bad" for e in api(url, "GET", "/audit").json()["data"])


def test_a_database_from_an_older_version_gets_the_new_columns(tmp_path):
    import sqlite3

    from cachegw.gateway.storage.recorder import SqlRequestLog
    from cachegw.gateway.storage.store import Store

    url = f"sqlite:///{tmp_path / 'old.db'}"
    Store(url).close()
    with sqlite3.connect(tmp_path / "old.db") as conn:  # as session 1's schema had it, before Alembic
        conn.execute("DROP TABLE alembic_version")
        conn.execute("DROP INDEX ix_requests_response_id")
        for table, column in (
            ("requests", "response_id"),
            ("requests", "query"),
            ("requests", "backend"),
            ("cache_entries", "threshold"),
        ):
            conn.execute(f'ALTER TABLE {table} DROP COLUMN "{column}"')
    store = Store(url)
    with sqlite3.connect(tmp_path / "old.db") as conn:
        cols = {r[1] for r in conn.execute("PRAGMA table_info(requests)")}
        assert {"response_id", "query", "backend"} <= cols
        assert "threshold" in {r[1] for r in conn.execute("PRAGMA table_info(cache_entries)")}
        assert "ix_requests_response_id" in {r[1] for r in conn.execute("PRAGMA index_list(requests)")}
    SqlRequestLog(store.session).log_requests(
        [RequestRecord.from_dict(log_row(1) | {"response_id": "chatcmpl-1", "backend": "http://b/v1"})]
    )
    store.close()


def test_verifier_switched_on_at_run_time_vetoes_the_next_lookup(backend_url, tmp_path):  # noqa: F811
    """Started with the verifier off, switched on through the admin API: the next negation misses.

    The gateway used to load the verifier only when the config enabled it, so switching it on at run
    time served hits with no verification at all.
    """
    with gateway(admin_settings(tmp_path, backend_url, verifier=False)) as url:
        t1, h1, _ = chat(url, ask("How do I boil an egg so the yolk stays soft?"))
        assert h1["x-cache"] == "miss"
        # cosine ~0.99: with the verifier off only the threshold decides, so the negation is served
        _, h2, _ = chat(url, ask("How do I boil an egg so the yolk does not stay soft?"))
        assert h2["x-cache"] == "semantic-hit"
        r = api(url, "PUT", "/settings", json={"verifier": {"enabled": True}})
        assert r.status_code == 200 and r.json()["verifier"]["enabled"] is True
        _, h3, _ = chat(url, ask("How do I boil an egg so the yolk doesn't stay soft?"))
        assert h3["x-cache"] == "miss"
        # and a real paraphrase still hits, so the switch did not just disable the semantic tier
        t4, h4, _ = chat(url, ask("how do I boil an egg so the yolk stays soft"))
        assert h4["x-cache"] == "semantic-hit" and t4 == t1


@pytest.mark.parametrize(
    "raw",
    [b'{"verdict": "bad", "request_id": "\\ud800"}', b"[" * 100_000 + b"]" * 100_000, b'{"x": NaN}'],
    ids=["lone-surrogate", "nested-100k", "nan"],
)
def test_feedback_bodies_that_were_500s_get_400(gw, raw):
    for url, token in ((f"{gw}/v1/cache/feedback", "tenant-a"), (f"{gw}/admin/api/feedback", TOKEN)):
        r = httpx.post(url, headers={"authorization": f"Bearer {token}"}, content=raw, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"], (url, r.text)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/entries/99999999999999999999999"),
        ("DELETE", "/entries/99999999999999999999999"),
        ("GET", "/entries?offset=99999999999999999999999"),
        ("GET", "/audit?offset=99999999999999999999999"),
    ],
)
def test_ids_beyond_a_sql_integer_get_400(gw, method, path):
    """They reached the database and overflowed its integer (500)."""
    assert api(gw, method, path).status_code == 400


def test_entry_id_beyond_a_sql_integer_in_feedback_gets_400(gw):
    r = api(gw, "POST", "/feedback", json={"entry_id": 10**30, "verdict": "bad"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "entry_id"


def test_the_admin_token_is_checked_before_the_parameters(gw):
    """A caller without the token must get 401, not a 400 that tells it which parameters exist."""
    for path in ("/entries/abc", "/entries?limit=abc", "/whatif?threshold=abc"):
        assert api(gw, "GET", path, token=None).status_code == 401
        assert api(gw, "GET", path).status_code == 400
