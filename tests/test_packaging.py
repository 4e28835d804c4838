"""Packaging: each install carries what it uses, so the gateway must not import what only extras bring."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
# Import names of the packages that only [engine], [reports], [dev] and [cuda] install.
EXTRA_ONLY = [
    "matplotlib",
    "rich",
    "tomlkit",
    "openai",
    "accelerate",
    "gguf",
    "llguidance",
    "jsonschema",
    "triton",
    "playwright",
    "psycopg",
    "redis",
]


def _name(req: str) -> str:
    for sep in "<>=;[ ":
        req = req.split(sep)[0]
    return req.strip().lower()


# Runs the imports as if the extra-only packages were not installed (third-party optional imports, such as
# httpx's CLI importing rich, then fall back as they would on a runtime-only install).
BLOCKED_IMPORTS = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
import cachegw.gateway.api.app, cachegw.gateway.serve, cachegw.gateway.cli
import cachegw.gateway.api.admin_api, cachegw.gateway.upstream.supervisor
print("ok")
"""


def test_gateway_imports_without_extra_only_packages() -> None:
    res = subprocess.run(
        [sys.executable, "-c", BLOCKED_IMPORTS, ",".join(EXTRA_ONLY)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "ok"


def test_report_and_engine_packages_are_extras_not_runtime() -> None:
    runtime = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert runtime.isdisjoint({"matplotlib", "rich", "tomlkit", "openai", "accelerate", "gguf", "triton"})
    assert {"rich", "matplotlib", "tomlkit"} <= {_name(r) for r in EXTRAS["reports"]}
    assert {"gguf", "safetensors", "llguidance"} <= {_name(r) for r in EXTRAS["engine"]}
    assert not any(_name(r) == "triton" for r in EXTRAS["dev"])
    assert any(r.startswith("cachegw[") and "engine" in r and "reports" in r for r in EXTRAS["dev"])


def test_license_file_matches_declared_license() -> None:
    assert PYPROJECT["project"]["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_the_wheel_ships_no_test_or_bench_code() -> None:
    """testkit/ (what tests/ and bench/ share) is linted and typed like the packages but never shipped."""
    import fnmatch

    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    for helper in ("testkit", "testkit.servers", "tests", "bench"):
        assert not any(fnmatch.fnmatch(helper, pattern) for pattern in include), helper
    assert "testkit" in PYPROJECT["tool"]["mypy"]["packages"]


MIGRATE_FROM_WHEEL = """
import sys
import cachegw.gateway as gateway
from cachegw.gateway.storage.migrate import head
from cachegw.gateway.storage.store import Store
assert gateway.__file__.startswith(sys.argv[1]), gateway.__file__
Store(f"sqlite:///{sys.argv[2]}").close()
print(head())
"""


def build_wheel(tmp_path: Path) -> Path:
    """The wheel, built from a copy of the sources git knows (setuptools writes build/ beside them and
    keeps stale files there): the packages and the root files the build reads (setup.py copies
    config.toml into the wheel)."""
    wheels, src = tmp_path / "wheels", tmp_path / "src"
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    tracked = subprocess.run(listed, cwd=ROOT, capture_output=True, text=True, check=True)
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    # the namespace's links (cachegw/gateway -> ../gateway) and the folders they point to
    linked = {p.name for name in packages if (ROOT / name).is_dir() for p in (ROOT / name).iterdir()}
    root_files = ("pyproject.toml", "setup.py", "MANIFEST.in", "config.toml", "README.md", "LICENSE")
    for name in tracked.stdout.splitlines():
        wanted = name.split("/")[0] in packages | linked or name in root_files
        if wanted and (ROOT / name).is_symlink():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).symlink_to(os.readlink(ROOT / name))
        elif wanted and (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, "-w", str(wheels), str(src)], check=True, capture_output=True, timeout=300)
    [wheel] = wheels.glob("cachegw-*.whl")
    return wheel


def test_an_installed_wheel_finds_its_migrations(tmp_path: Path) -> None:
    """The migration scripts ship as package data: a wheel installed elsewhere builds a database with them."""
    target = tmp_path / "site"
    wheel = build_wheel(tmp_path)
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    res = subprocess.run(
        [sys.executable, "-c", MIGRATE_FROM_WHEEL, str(target), str(tmp_path / "new.db")],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    import sqlite3

    with sqlite3.connect(tmp_path / "new.db") as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == (res.stdout.strip(),)


def test_the_wheel_ships_every_cpu_kernel_source() -> None:
    """An installed engine builds its CPU kernels from the sources in the wheel: the .cpp and every
    header it includes must be package data, or the first start on a new machine has no kernels."""
    import fnmatch

    from cachegw.backend.executor.layers.cpu_kernels import SOURCES

    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["*"]
    for source in SOURCES:
        assert any(fnmatch.fnmatch(source.name, p) for p in patterns), source.name
