"""`cachegw serve` with a busy port stops at once, naming the port, before it loads any model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as other:  # another server listens there
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-X",
        "importtime",
        "-m",
        "cachegw.gateway.cli",
        "serve",
        "--data-dir",
        str(tmp_path),
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def loaded_torch(stderr: str) -> bool:
    """From `-X importtime`: lines end in `| <indent>module`, nested imports indented further."""
    return any(
        line.startswith("import time:") and line.split("|")[-1].strip() == "torch"
        for line in stderr.splitlines()
    )


def test_a_busy_gateway_port_stops_the_start_naming_it(tmp_path: Path, busy_port: int) -> None:
    proc = serve(tmp_path, "--port", str(busy_port))
    assert proc.returncode == 2
    assert f"cachegw: error: port {busy_port} on 127.0.0.1 for the gateway is in use" in proc.stderr
    assert not loaded_torch(proc.stderr)  # it stopped before any model (or torch) was loaded
    assert "Traceback" not in proc.stderr


def test_a_busy_builtin_backend_port_stops_the_start_naming_it(tmp_path: Path, busy_port: int) -> None:
    from testkit.servers import free_port

    config = tmp_path / "config.toml"
    config.write_text(f"[backend_server]\nport = {busy_port}\n")
    proc = serve(tmp_path, "--config", str(config), "--port", str(free_port()))
    assert proc.returncode == 2
    assert f"port {busy_port} on 127.0.0.1 for the built-in backend" in proc.stderr
    assert not loaded_torch(proc.stderr)
