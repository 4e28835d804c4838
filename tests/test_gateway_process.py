"""`cachegw serve` as a real process: kill -9 keeps committed entries; the supervised built-in
backend is restarted when it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.servers import free_port
from tests.test_gateway import MODEL, ask, backend_url  # noqa: F401  (module fixture reused)

pytestmark = pytest.mark.slow


def start_serve(config: Path, data_dir: Path, port: int, log: Path | None = None) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--config",
        str(config),
        "--data-dir",
        str(data_dir),
        "--port",
        str(port),
    ]
    out = log.open("w") if log is not None else None
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=out, start_new_session=True)


def wait_health(port: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"cachegw serve exited with {proc.returncode}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("cachegw serve did not become healthy")


def post(port: int, messages: list[dict]) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        timeout=120,
        headers={"Authorization": "Bearer k"},
        json={"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 16},
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_kill_9_keeps_committed_entries(backend_url, tmp_path):  # noqa: F811
    config = tmp_path / "cachegw.toml"
    config.write_text(f'[gateway]\nbackends = ["{backend_url}"]\n')
    port = free_port()
    proc = start_serve(config, tmp_path / "data", port)
    try:
        wait_health(port, proc)
        first = post(port, ask("What is the boiling point of water?"))
        assert first.headers["x-cache"] == "miss"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no shutdown, no flush
        proc.wait(10)
    proc = start_serve(config, tmp_path / "data", port)
    try:
        wait_health(port, proc)
        again = post(port, ask("What is the boiling point of water?"))
        assert again.headers["x-cache"] == "exact-hit"
        assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        para = post(port, ask("What's the boiling point of water?"))
        assert para.headers["x-cache"] == "semantic-hit"  # the vector index was rebuilt from the database
    finally:
        stop(proc)


def test_kill_9_after_an_index_snapshot_reconciles_it(backend_url, tmp_path):  # noqa: F811
    """An HNSW scope saved when it was built, one more entry, kill -9 (no shutdown save): the restart
    reads the stale snapshot, adds the entry it lacks, and both old and new entries hit."""
    config = tmp_path / "cachegw.toml"
    config.write_text(f'[gateway]\nbackends = ["{backend_url}"]\n[index]\nhnsw_threshold = 5\n')
    questions = [
        "How do I bake bread?",
        "Name a planet.",
        "What is a prime number?",
        "Who wrote Hamlet?",
        "How far away is the Moon?",
        "Why is the sky blue?",  # the sixth: written after the snapshot of the first five
    ]
    port, data = free_port(), tmp_path / "data"
    proc = start_serve(config, data, port)
    try:
        wait_health(port, proc)
        for q in questions[:5]:
            assert post(port, ask(q)).headers["x-cache"] == "miss"
        deadline = time.monotonic() + 30  # the switch to HNSW and its snapshot run in the background
        while not list((data / "index").glob("*.hnsw")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list((data / "index").glob("*.hnsw")), "no snapshot was written"
        assert post(port, ask(questions[5])).headers["x-cache"] == "miss"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    log = tmp_path / "restart.log"
    proc = start_serve(config, data, port, log)
    try:
        wait_health(port, proc)
        assert "read from its snapshot: 6 entries, 1 added, 0 tombstoned" in log.read_text()
        for q in ("who wrote hamlet", "why is the sky blue"):
            assert post(port, ask(q)).headers["x-cache"] == "semantic-hit"
    finally:
        stop(proc)


def test_supervised_builtin_backend_is_restarted(tmp_path):
    backend_port, port = free_port(), free_port()
    config = tmp_path / "cachegw.toml"
    config.write_text(
        f'[gateway]\nbuiltin_backend_port = {backend_port}\n[engine]\ndtype = "float32"\n'
        "kv_cache_tokens = 4096\nmax_num_seqs = 4\n"
    )
    proc = start_serve(config, tmp_path / "data", port)
    try:
        wait_health(port, proc)
        assert post(port, ask("Name a color.")).status_code == 200
        pattern = f"gateway.cli backend .*--port {backend_port}"
        pid = int(subprocess.check_output(["pgrep", "-f", pattern]).split()[0])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline:
            r = post(port, ask("Name an animal."))
            status = r.status_code
            if status == 200:
                break
            # while the backend is down the gateway says so clearly: refused (502), then, once the
            # health probes marked it down, 503 with Retry-After without trying it
            assert status == 502 or (status == 503 and r.headers["retry-after"] == "5"), r.text
            time.sleep(1)
        assert status == 200, "the backend was not restarted"
    finally:
        stop(proc)


def test_metrics_on_their_own_port_and_per_request_log_rows_survive_kill_9(backend_url, tmp_path):  # noqa: F811
    """`[gateway] metrics_port` serves /metrics on a second listener of the same process and not on the
    main port; with `request_log_commit = "per_request"` every answered request's row is in the
    database when the gateway is killed with -9 right after the last answer (batched: the last
    0.2 s of rows were lost, issue 13)."""
    import sqlite3

    port, metrics_port = free_port(), free_port()
    config = tmp_path / "cachegw.toml"
    config.write_text(
        f'[gateway]\nbackends = ["{backend_url}"]\nrequest_log_commit = "per_request"\n'
        f'metrics_port = {metrics_port}\nmetrics_token = "scrape-me"\n'
    )
    data = tmp_path / "data"
    proc = start_serve(config, data, port)
    ids = []
    try:
        wait_health(port, proc)
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 404
        side = f"http://127.0.0.1:{metrics_port}/metrics"
        assert httpx.get(side, timeout=10).status_code == 401
        for q in ("Name a river.", "Name a mountain.", "Name a river.", "Name a lake."):
            r = post(port, ask(q))
            assert r.status_code == 200
            ids.append(r.headers["x-request-id"])
        scrape = httpx.get(side, headers={"authorization": "Bearer scrape-me"}, timeout=10)
        assert (
            scrape.status_code == 200
            and 'cachegw_gateway_requests_total{result="exact-hit"} 1.0' in scrape.text
        )
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # right after the last answer: no shutdown, no flush
        proc.wait(10)
    with sqlite3.connect(data / "cachegw.db") as conn:
        rows = {r[0] for r in conn.execute("SELECT id FROM requests")}
    assert set(ids) <= rows
