"""Active backend health: a backend that hangs (accepts connections, never answers) is marked down by the
probes; misses then get 503 `backend_unavailable` with `Retry-After` at once, exact hits are still
served, /health says degraded, routing skips it; one answered probe marks it up again.

The backends are small OpenAI-compatible test servers (testkit/servers.py ``recording_upstream``) that can
be made to hang on demand, as a SIGSTOPped server does; tests/test_supervisor_faults.py stops the real
engine. The gateway, SQLite and HTTP are real. Probes run every 0.1 s here, so the tests wait for the
state /health reports rather than for a time."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from cachegw.gateway.metrics import BackendCounts, GatewayMetrics
from cachegw.gateway.upstream.health import HealthProbes, health_url
from cachegw.gateway.upstream.proxy import Backends
from testkit.servers import Upstream, recording_upstream, serve_in_thread
from tests.test_gateway import gateway, settings_for

FAST = {"probe_interval_s": 0.1, "probe_timeout_s": 0.3, "probe_misses": 2}


def fast_settings(tmp_path: Path, backends: list[str], routing: str = "prefix"):
    s = settings_for(tmp_path, backends)
    return s.model_copy(update={"gateway": s.gateway.model_copy(update={**FAST, "routing": routing})})


def ask(url: str, question: str, model: str = "m") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0}
    return httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"authorization": "Bearer t"}, timeout=60
    )


def wait_for(condition: Callable[[], bool], what: str, limit_s: float = 60) -> None:
    """Until ``condition`` holds (probes run in the background); fails naming ``what`` after a minute."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.05)


def test_a_hung_backend_is_marked_down_misses_fail_fast_hits_served_then_it_recovers(tmp_path: Path) -> None:
    up = Upstream("m")
    with serve_in_thread(recording_upstream(up)) as backend:
        with gateway(fast_settings(tmp_path, [f"{backend}/v1"])) as url:
            admin = {"authorization": f"Bearer {(tmp_path / 'admin_token').read_text().strip()}"}

            def health() -> httpx.Response:
                return httpx.get(f"{url}/health", headers=admin, timeout=30)

            first = ask(url, "Sky colour?")
            assert first.status_code == 200 and first.headers["x-cache"] == "miss"
            up.hang = True  # the backend stops answering; its socket still accepts connections
            wait_for(lambda: health().status_code == 503, "marked down")
            assert health().json()["backends_down"] == [f"{backend}/v1"]
            sent = len(up.requests("/v1/chat/completions"))
            miss = ask(url, "Grass colour?")
            assert miss.status_code == 503 and miss.headers["retry-after"] == "1"
            error = miss.json()["error"]
            assert error["code"] == "backend_unavailable" and error["type"] == "backend_error"
            assert len(up.requests("/v1/chat/completions")) == sent  # never sent to the hung backend
            hit = ask(url, "Sky colour?")
            assert hit.status_code == 200 and hit.headers["x-cache"] == "exact-hit"
            up.hang = False  # it answers again: the next probe marks it up
            wait_for(lambda: health().status_code == 200, "marked up again")
            again = ask(url, "Grass colour?")
            assert again.status_code == 200 and again.headers["x-cache"] == "miss"
    # the 503 is in the request log like any failure
    wait_for(lambda: bool(_logged_errors(tmp_path)), "logged", 10)
    assert _logged_errors(tmp_path) == [(503, "backend_unavailable")]


def _logged_errors(data_dir: Path) -> list[tuple[int, str]]:
    with sqlite3.connect(data_dir / "cachegw.db") as db:
        rows = db.execute("SELECT status, error FROM requests WHERE status >= 400").fetchall()
    return [(status, error.split(":")[0]) for status, error in rows]


def test_routing_skips_a_hung_backend(tmp_path: Path) -> None:
    """Two backends for one model: once the first hangs and is marked down, every miss goes to the
    second without being sent to the first."""
    first, second = Upstream("m", answer="from-first"), Upstream("m", answer="from-second")
    with (
        serve_in_thread(recording_upstream(first)) as url_1,
        serve_in_thread(recording_upstream(second)) as url_2,
    ):
        with gateway(fast_settings(tmp_path, [f"{url_1}/v1", f"{url_2}/v1"], routing="first")) as url:
            assert ask(url, "Question 0?").json()["choices"][0]["message"]["content"] == "from-first"
            first.hang = True
            wait_for(lambda: _down(url, tmp_path) == [f"{url_1}/v1"], "marked down")
            sent = len(first.requests("/v1/chat/completions"))
            for i in range(1, 4):
                r = ask(url, f"Question {i}?")
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "from-second"
            assert len(first.requests("/v1/chat/completions")) == sent
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # the model is still served
            first.hang = False


def _down(url: str, tmp_path: Path) -> list[str]:
    admin = {"authorization": f"Bearer {(tmp_path / 'admin_token').read_text().strip()}"}
    return httpx.get(f"{url}/health", headers=admin, timeout=30).json()["backends_down"]


async def test_probe_falls_back_to_models_and_counts_misses_in_a_row() -> None:
    """/health not found -> /v1/models (remembered); a refused connection is a miss; one answer resets."""
    up = Upstream("m")
    app = recording_upstream(up)
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/health"]
    with serve_in_thread(app) as base:
        backends = Backends([f"{base}/v1"], 1.0, 1.0)
        probes = HealthProbes(backends, interval_s=1.0, timeout_s=1.0, misses=2)
        try:
            await probes.round()
            assert backends.down == set() and probes.state[f"{base}/v1"].use_models
            await probes.round()
            assert [path for _, path, _, _ in up.seen] == ["/health", "/v1/models", "/v1/models"]
        finally:
            await backends.close()
    assert health_url("http://h:8000/v1") == "http://h:8000/health"
    gone = Backends([f"{base}/v1"], 1.0, 1.0)  # the server is stopped: connections are refused
    probes = HealthProbes(gone, interval_s=1.0, timeout_s=1.0, misses=2)
    try:
        await probes.round()
        assert gone.down == set()  # one miss is not enough
        await probes.round()
        assert gone.down == {f"{base}/v1"}
        metrics = GatewayMetrics(
            lambda: 0.0, BackendCounts(gone.answered, gone.refused, gone.urls, gone.down)
        )
        assert f'cachegw_gateway_backend_up{{backend="{base}/v1"}} 0.0' in metrics.render().decode()
    finally:
        await gone.close()


def test_requests_already_waiting_on_a_backend_that_hangs_give_up_when_it_is_marked_down(
    tmp_path: Path,
) -> None:
    """A JSON miss sent just before the backend hung gets the 503 (not a 504 after backend_timeout_s),
    and a stream that stalls mid-answer ends with an SSE error event naming the probes."""
    up = Upstream("m")
    with serve_in_thread(recording_upstream(up)) as backend:
        s = fast_settings(tmp_path, [f"{backend}/v1"])
        slow = {"probe_misses": 5, "backend_timeout_s": 60.0}  # marked down well after the request is in
        s = s.model_copy(update={"gateway": s.gateway.model_copy(update=slow)})
        with gateway(s) as url, ThreadPoolExecutor(2) as pool:
            assert ask(url, "Sky colour?").status_code == 200  # the gateway knows the backend's model
            up.hang = True
            waiting = pool.submit(ask, url, "Grass colour?")
            wait_for(lambda: len(up.requests("/v1/chat/completions")) == 2, "sent to the backend")
            assert _down(url, tmp_path) == []  # it reached the backend before the probes gave up on it
            miss = waiting.result()
            assert miss.status_code == 503 and miss.headers["retry-after"] == "1", miss.text
            assert miss.json()["error"]["code"] == "backend_unavailable"
            up.hang = False
            wait_for(lambda: _down(url, tmp_path) == [], "marked up again")

            up.stall_streams = True
            body = {"model": "m", "messages": [{"role": "user", "content": "Sea colour?"}], "temperature": 0}

            def stream() -> str:
                with httpx.stream(
                    "POST",
                    f"{url}/v1/chat/completions",
                    json={**body, "stream": True},
                    headers={"authorization": "Bearer t"},
                    timeout=120,
                ) as r:
                    return r.read().decode()

            streaming = pool.submit(stream)
            wait_for(lambda: len(up.requests("/v1/chat/completions")) == 3, "stream sent")
            up.hang = True  # now the probes stop getting answers too
            events = streaming.result()
            up.hang = up.stall_streams = False
    assert '"content": "blue"' in events and "[DONE]" not in events
    error = json.loads(events.strip().split("\n\n")[-1].removeprefix("data: "))["error"]
    assert error["code"] == "backend_error" and "health probes" in error["message"]
