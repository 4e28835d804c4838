"""A hung engine under `cachegw serve`: how soon misses fail fast, whether hits are served, when it heals.

Starts `cachegw serve` with the built-in engine on free ports (config.toml defaults otherwise: probes
every 5 s, 2 s timeout, 2 misses), stores one answer, then SIGSTOPs the engine process and, once a
second, sends one new question (a miss) and the stored one (an exact hit) until misses are answered
again (the supervisor kills the hung engine and starts a new one). Prints and saves the timeline.

    .venv/bin/python -m bench.hung_backend          # about 1-2 minutes on 2 CPU cores
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import ROOT, save, say

MODEL = "SmolLM2-135M-Instruct"
LIMIT_S = 240.0


def ask(url: str, question: str) -> dict:
    start = time.monotonic()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 8,
    }
    r = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"authorization": "Bearer bench"}, timeout=400
    )
    return {
        "status": r.status_code,
        "x_cache": r.headers.get("x-cache"),
        "retry_after": r.headers.get("retry-after"),
        "seconds": round(time.monotonic() - start, 3),
    }


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="cachegw-hung-"))
    gw_port, engine_port = free_port(), free_port()
    (tmp / "config.toml").write_text(f"[gateway]\nport = {gw_port}\n[backend_server]\nport = {engine_port}\n")
    cmd = [sys.executable, "-m", "cachegw.gateway.cli", "serve", "--config", str(tmp / "config.toml")]
    log = (tmp / "serve.log").open("w")
    proc = subprocess.Popen(
        [*cmd, "--data-dir", str(tmp / "data")], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{gw_port}"
    engine: int | None = None
    try:
        deadline = time.monotonic() + 300
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the gateway did not start: see {tmp / 'serve.log'}")
            time.sleep(0.5)
        warm = ask(url, "What is the capital of France?")
        pids = subprocess.check_output(
            ["pgrep", "-P", str(proc.pid), "-f", "cachegw.gateway.cli backend"]
        ).split()
        engine = int(pids[0])
        os.kill(engine, signal.SIGSTOP)
        t0 = time.monotonic()
        say(f"engine {engine} stopped (SIGSTOP)")
        timeline = []
        for i in range(1, 10_000):
            miss = ask(url, f"Question number {i}?")
            hit = ask(url, "What is the capital of France?")
            health = _status(url)
            row = {"t": round(time.monotonic() - t0, 1), "miss": miss, "hit": hit, "health": health}
            timeline.append(row)
            say(f"t={row['t']:6.1f}s miss {miss} hit {hit} /health {health}")
            if miss["status"] == 200 or time.monotonic() - t0 > LIMIT_S:
                break
            time.sleep(1.0)
    finally:
        if engine is not None:
            try:
                os.kill(engine, signal.SIGCONT)
            except ProcessLookupError:
                pass
        proc.terminate()
        proc.wait(60)
    failed = [r for r in timeline if r["miss"]["status"] == 503]
    summary = {
        "warm_miss": warm,
        "first_miss_503_after_s": failed[0]["t"] if failed else None,
        "first_miss_503_waited_s": failed[0]["miss"]["seconds"] if failed else None,
        "later_503_seconds_max": max((r["miss"]["seconds"] for r in failed[1:]), default=None),
        "retry_after": sorted({r["miss"]["retry_after"] for r in failed}),
        "hits_served": sum(
            r["hit"]["status"] == 200 and r["hit"]["x_cache"] == "exact-hit" for r in timeline
        ),
        "hits_tried": len(timeline),
        "misses_answered_again_after_s": timeline[-1]["t"] if timeline[-1]["miss"]["status"] == 200 else None,
    }
    say(str(summary))
    save("hung_backend", {"summary": summary, "timeline": timeline})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _status(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _healthy(url: str) -> bool:
    return _status(url) == 200


if __name__ == "__main__":
    main()
