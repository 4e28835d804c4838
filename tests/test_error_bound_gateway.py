"""The false-hit bound end to end: the real gateway on loopback, real SQLite, the openai SDK.

The backend is the small OpenAI-compatible test server of testkit/servers.py (``recording_upstream``):
its answer is whatever the test sets, so an audit's verdict is known in advance (the built-in engine
cannot be told which answers are right), and it can be made to hang to show that an audit never holds
up the client. The verifier is off, so the score the line applies to is the cosine.

Numbers used throughout: target 0.3 at confidence 0.8 needs 5 clean audits (``min_audits``); one wrong
in 7 puts the bound at 0.37 (over), two wrong in 14 at 0.28 (under).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from cachegw.gateway.config import Settings
from testkit.servers import Upstream, recording_upstream, serve_in_thread
from tests.test_gateway import MODEL, MovableClock, ask, chat, gateway, settings_for

TOKEN = "error-bound-admin-token-123456"
Q0 = "What is the capital of France?"
P1 = "what's the capital of france"  # cosine 0.908 to Q0 (the 0.90 cell)
SHORT = {
    "x-cache-ttl": "1"
}  # paraphrases' own answers expire at once (the clock moves): Q0 stays the one judged


def bound_settings(data_dir: Path, backend: str, **over: object) -> Settings:
    cache = {
        "verifier": False,
        "exact": False,  # repeats of Q0 go through the semantic tier: score 1.0
        "max_false_hit_rate": 0.3,
        "false_hit_confidence": 0.8,
        "audit_fraction": 1.0,
        "audit_max_per_second": 1000.0,
        "sync_interval_s": 0.2,
        "false_hit_prior": "none",  # from no evidence at all (tests/test_bound_prior.py: with a prior)
        **over,
    }
    s = settings_for(data_dir, [backend], **cache)
    return s.model_copy(update={"admin": s.admin.model_copy(update={"token": TOKEN})})


@pytest.fixture
def upstream() -> Iterator[tuple[Upstream, str]]:
    up = Upstream(model=MODEL, answer="Paris")
    with serve_in_thread(recording_upstream(up)) as url:
        yield up, f"{url}/v1"


def api(url: str, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(
        method, f"{url}/admin/api{path}", headers={"authorization": f"Bearer {TOKEN}"}, timeout=60, **kw
    )


def scope_view(url: str) -> dict:
    """The one scope's false_hit_rate entry (empty before any evidence)."""
    by_scope = api(url, "GET", "/stats").json()["false_hit_rate"]["by_scope"]
    return next(iter(by_scope.values()), {})


def eventually(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def ask_and_audit(url: str, text: str, clock: MovableClock, headers: dict | None = None) -> dict:
    """One request; waits for its audit to be counted (every request here is audited)."""
    before = scope_view(url).get("evidence", 0)
    _, h, _ = chat(url, ask(text), max_tokens=8, extra_headers=headers or {})
    eventually(lambda: scope_view(url).get("evidence", 0) > before)
    clock.advance(5)  # any paraphrase stored with a 1 s TTL is expired for the next lookup
    return h


def test_the_line_rises_after_wrong_hits_and_relaxes_as_right_ones_accumulate(upstream, tmp_path) -> None:
    up, backend = upstream
    clock = MovableClock()
    with gateway(bound_settings(tmp_path, backend), clock) as url:
        assert chat(url, ask(Q0), max_tokens=8)[1]["x-cache"] == "miss"  # stored: "Paris"
        # no evidence: no semantic hit at all, each near miss compared with its fresh answer
        for _ in range(5):
            h = ask_and_audit(url, Q0, clock)
            assert (h["x-cache"], h["x-cache-reason"]) == ("miss", "error-bound")
        assert scope_view(url)["line"] == 1.0  # 5 right audits at score 1.0
        assert ask_and_audit(url, P1, clock, SHORT)["x-cache"] == "miss"  # a near miss, audited
        assert scope_view(url)["line"] == 0.9  # one right audit at 0.908 extends the line
        assert ask_and_audit(url, P1, clock, SHORT)["x-cache"] == "semantic-hit"  # re-asked: right
        up.answer = "Lyon"  # from now on the stored "Paris" is a wrong answer
        assert ask_and_audit(url, P1, clock, SHORT)["x-cache"] == "semantic-hit"  # audited: wrong
        view = scope_view(url)
        assert view["line"] == 1.0 and view["wrong"] == 0  # the line rose above the wrong hit
        assert ask_and_audit(url, P1, clock, SHORT)["x-cache"] == "miss"  # a near miss, audited
        up.answer = "Paris"
        served = []
        for _ in range(14):  # right answers accumulate at 0.908
            served.append(ask_and_audit(url, P1, clock, SHORT)["x-cache"])
            if served[-1] == "semantic-hit":
                break
        # Q0's entry has 5 audits of its own (min_audits here), all at 0.908: its own line decides, and
        # it needs two wrong in 14 of its own (the scope's five at 1.0 would have let it serve at 6)
        assert served[-1] == "semantic-hit" and len(served) == 11
        view = scope_view(url)
        assert view["line"] == 0.9 and view["wrong"] == 2 and view["audits"] >= 14


def test_audits_never_delay_the_client_and_the_budget_holds(upstream, tmp_path) -> None:
    """A hit is answered while its audit's re-ask hangs in the backend; over budget, audits drop."""
    up, backend = upstream
    clock = MovableClock()
    settings = bound_settings(tmp_path, backend, audit_max_per_second=0.001, audit_send_priority="always")
    with gateway(settings, clock) as url:
        chat(url, ask(Q0), max_tokens=8)
        r = api(url, "PUT", "/settings", json={"error_bound": {"audit_max_per_second": 1000}})
        assert r.status_code == 200
        for _ in range(5):
            ask_and_audit(url, Q0, clock)
        assert scope_view(url)["line"] == 1.0
        sent = len(up.requests("/v1/chat/completions"))
        up.hang = True  # the audit's re-ask will wait, unanswered
        try:
            _, h, _ = chat(url, ask(Q0), max_tokens=8)
            assert h["x-cache"] == "semantic-hit"  # answered...
            eventually(
                lambda: len(up.requests("/v1/chat/completions")) == sent + 1
            )  # ...its audit still hangs
            reask = json.loads(up.requests("/v1/chat/completions")[-1][3])
            assert reask["priority"] == 10 and "stream" not in reask  # at the audits' low priority
            assert scope_view(url)["evidence"] == 5
        finally:
            up.hang = False
        eventually(lambda: scope_view(url)["evidence"] == 6)
        # budget: a bucket of 0.001/s holds one token; of 6 hits, one is audited and five dropped
        assert (
            api(url, "PUT", "/settings", json={"error_bound": {"audit_max_per_second": 0.001}}).status_code
            == 200
        )
        for _ in range(6):
            assert chat(url, ask(Q0), max_tokens=8)[1]["x-cache"] == "semantic-hit"
        stats = api(url, "GET", "/stats").json()["false_hit_rate"]
        eventually(lambda: scope_view(url)["evidence"] == 7)
        assert stats["audits_by_verdict"]["dropped"] == 5
        assert len(up.requests("/v1/chat/completions")) == sent + 2  # 1 miss + 5 near misses were before
        metrics = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30).text
        assert 'cachegw_gateway_audits_total{verdict="dropped"} 5.0' in metrics
        assert "cachegw_gateway_false_hit_rate_estimate{scope=" in metrics


def test_evidence_survives_a_restart_and_a_replica_sees_it(upstream, tmp_path) -> None:
    """Two gateways on one SQLite file: B counts A's audits on its sync; a restarted A reads them back."""
    _, backend = upstream
    db = f"sqlite:///{tmp_path / 'shared.db'}"

    def on_db(name: str) -> Settings:
        s = bound_settings(tmp_path / name, backend)
        return s.model_copy(update={"gateway": s.gateway.model_copy(update={"database_url": db})})

    clock = MovableClock()
    with gateway(on_db("a"), clock) as a, gateway(on_db("b"), clock) as b:
        chat(a, ask(Q0), max_tokens=8)
        for _ in range(5):
            ask_and_audit(a, Q0, clock)
        eventually(lambda: scope_view(b).get("evidence") == 5)
        assert scope_view(b)["line"] == 1.0
    with gateway(on_db("a"), clock) as a:
        view = scope_view(a)
        assert view["evidence"] == 5 and view["line"] == 1.0


def test_the_admin_api_changes_the_target_live_and_refuses_bad_values(upstream, tmp_path) -> None:
    _, backend = upstream
    with gateway(bound_settings(tmp_path, backend, max_false_hit_rate=0.0), MovableClock()) as url:
        chat(url, ask(Q0), max_tokens=8)
        assert chat(url, ask(P1), max_tokens=8)[1]["x-cache"] == "semantic-hit"  # off: today's static line
        r = api(url, "PUT", "/settings", json={"error_bound": {"models": {MODEL: 0.02}}})
        assert r.status_code == 200 and r.json()["error_bound"]["models"] == {MODEL: 0.02}
        h = chat(url, ask(P1 + "?"), max_tokens=8)[1]
        assert (h["x-cache"], h["x-cache-reason"]) == ("miss", "error-bound")  # no evidence: conservative
        for bad in (
            {"max_false_hit_rate": 1.0},
            {"max_false_hit_rate": -0.1},
            {"max_false_hit_rate": "low"},
            {"models": {MODEL: 2}},
            {"audit_fraction": 1.5},
            {"audit_max_per_second": -1},
            {"confidence": 0.9},
        ):
            r = api(url, "PUT", "/settings", json={"error_bound": bad})
            assert r.status_code == 400, bad
            assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
        assert api(url, "GET", "/settings").json()["error_bound"]["models"] == {MODEL: 0.02}
