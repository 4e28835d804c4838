"""The wheel serves: built from the sources, installed into a fresh venv, `cachegw serve` started from
an empty directory (no checkout, no config.toml) with its settings from the environment only, and one
chat request answered through it from the shared test engine.

The venv borrows the test interpreter's installed dependencies through a .pth line (installing torch
again would take minutes), while the project's own code comes only from the wheel: a plain path line
does not run the editable install's import hook, and the test checks where `gateway` is loaded from.
Marked ``wheel`` (and ``slow``): ``-m "not wheel"`` skips it; it needs no network (``--no-deps``,
``--no-build-isolation``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest

from testkit.servers import free_port
from tests.test_gateway import MODEL
from tests.test_gateway_process import stop, wait_health
from tests.test_packaging import ROOT, build_wheel

pytestmark = [pytest.mark.slow, pytest.mark.wheel]


def serve_env(tmp_path: Path, port: int, backend_url: str) -> dict[str, str]:
    """`cachegw serve` configured by the environment alone: its port, data dir and backend."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEGW_") and k != "PYTHONPATH"}
    return {
        **env,
        "HF_HUB_OFFLINE": "1",
        "CACHEGW_GATEWAY__PORT": str(port),
        "CACHEGW_GATEWAY__DATA_DIR": str(tmp_path / "data"),
        "CACHEGW_GATEWAY__BACKENDS": json.dumps([backend_url]),  # a JSON list of strings is TOML too
    }


def start(cmd: list[str], env: dict[str, str], cwd: Path, log: Path | None) -> subprocess.Popen:
    out = log.open("w") if log is not None else None
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=out, start_new_session=True)


def make_venv(tmp_path: Path, wheel: Path) -> Path:
    """A venv with the wheel installed (no dependencies) and this interpreter's packages beside it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    subprocess.run([*install, "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    return venv


WHERE = """
import cachegw.configtools.loader as loader, cachegw.gateway as gateway
print(gateway.__file__)
print(loader.defaults_text() == (loader.resources.files("cachegw.configtools") / "defaults.toml").read_text())
"""


def test_the_installed_wheel_serves(shared_backend_url: str, tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:  # one source of the defaults: the wheel's copy is config.toml
        assert z.read("cachegw/configtools/defaults.toml") == (ROOT / "config.toml").read_bytes()
        # one namespace in site-packages: no generic top-level names such as gateway or backend
        assert {name.split("/")[0] for name in z.namelist()} == {"cachegw", "cachegw-0.1.0.dist-info"}
    venv = make_venv(tmp_path, wheel)
    empty = tmp_path / "run"
    empty.mkdir()
    env = serve_env(tmp_path, free_port(), shared_backend_url)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"

    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", WHERE], cwd=empty, env=env, capture_output=True, text=True
    )
    assert where.returncode == 0, where.stderr[-2000:]
    module, packaged = where.stdout.split()
    assert Path(module).is_relative_to(venv), module  # the project's code is the wheel's, not the checkout's
    assert packaged == "True"
    version = subprocess.run(["cachegw", "--version"], cwd=empty, env=env, capture_output=True, text=True)
    assert version.stdout.strip() == "cachegw 0.1.0", version

    port = int(env["CACHEGW_GATEWAY__PORT"])
    token = tmp_path / "admin_token"  # a secret from a file (else a generated one is printed once)
    token.write_text("cgw-admin-from-a-file\n")
    env["CACHEGW_ADMIN__TOKEN_FILE"] = str(token)
    log = tmp_path / "serve.log"
    proc = start(["cachegw", "serve", "--log-format", "json"], env, empty, log)
    try:
        wait_health(port, proc)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"Authorization": "Bearer k"},
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Name one primary colour."}],
                "max_tokens": 8,
                "temperature": 0,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        admin = httpx.get(
            f"http://127.0.0.1:{port}/admin/api/settings",
            headers={"Authorization": "Bearer cgw-admin-from-a-file"},
        )
        assert admin.status_code == 200, admin.text
    finally:
        stop(proc)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert lines and all({"ts", "level", "logger", "message"} <= set(line) for line in lines)
    access = [line["message"] for line in lines if line["logger"] == "uvicorn.access"]
    assert any("/v1/chat/completions" in message for message in access)
    assert not (empty / "data").exists()  # the data dir came from the environment
