"""`cachegw backend` as a real OS process, for tests and benchmarks of what happens across its start and
stop (the KV tier a SIGTERM writes, a kill -9): start it on a free port, wait until it serves, stop it
with a signal, ask it for completions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class BackendProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        """Send ``sig`` and wait for the exit; its status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    @property
    def model(self) -> str:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as r:
            return str(json.loads(r.read())["data"][0]["id"])


def start_backend(config: Path, log: Path, port: int, *args: str, timeout: float = 300.0) -> BackendProcess:
    """``cachegw backend --config CONFIG --port PORT ARGS``, its output in ``log``, once /health answers."""
    cmd = [sys.executable, "-m", "cachegw.gateway.cli", "backend", "--config", str(config)]
    cmd += ["--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log.open("ab") as out:
        proc = subprocess.Popen([*cmd, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    backend = BackendProcess(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"cachegw backend exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(backend.url + "/health", timeout=5):
                return backend
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"cachegw backend did not answer within {timeout} s:\n{log.read_text()[-3000:]}")


@dataclass(frozen=True)
class Completion:
    text: str
    cached_tokens: int
    prompt_tokens: int


def complete(backend: BackendProcess, prompt: list[int] | str, max_tokens: int = 8) -> Completion:
    """A greedy /v1/completions answer and what its usage says was cached."""
    body = {"model": backend.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(
        backend.url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    usage = out["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Completion(out["choices"][0]["text"], cached, usage["prompt_tokens"])
