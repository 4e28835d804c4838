"""Inductor's compile cache lands under cachegw's cache folder, not torch's default in /tmp.

Each case runs in a fresh interpreter (Inductor settles the folder once per process) and asks
Inductor which folder it will use, compiling nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_WHERE = (
    "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
    "from torch._inductor.codecache import FxGraphCache\n"
    "print(cache_dir()); print(FxGraphCache._get_tmp_dir())\n"
)


def _inductor_dirs(code: str, **env: str) -> list[Path]:
    base = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "CACHEGW_CACHE_DIR")}
    done = subprocess.run(
        [sys.executable, "-c", code + _WHERE],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [Path(line) for line in done.stdout.split()[-2:]]


def test_backend_command_puts_the_cache_under_the_configured_cache_dir(tmp_path: Path) -> None:
    """`cachegw backend` names the folder from [engine] cache_dir (CACHEGW_CACHE_DIR here) before the
    engine, and with it Inductor's config, is imported."""
    code = (
        "from cachegw.backend.config import load_engine_config\n"
        "from cachegw.backend.entrypoints.command import use_inductor_cache\n"
        "use_inductor_cache(load_engine_config(None))\n"
        "import cachegw.backend.core.engine\n"
    )
    where, graphs = _inductor_dirs(code, CACHEGW_CACHE_DIR=str(tmp_path))
    assert where == tmp_path / "inductor"
    assert graphs.is_relative_to(tmp_path / "inductor")


def test_the_engine_alone_uses_cachegw_s_folder_in_home(tmp_path: Path) -> None:
    """Without the command (the Python API), importing the engine names ~/.cache/cachegw/inductor."""
    where, _ = _inductor_dirs("import cachegw.backend.core.engine\n", HOME=str(tmp_path))
    assert where == tmp_path / ".cache" / "cachegw" / "inductor"


def test_a_folder_the_user_names_wins(tmp_path: Path) -> None:
    code = (
        "from cachegw.backend.config import load_engine_config\n"
        "from cachegw.backend.entrypoints.command import use_inductor_cache\n"
        "use_inductor_cache(load_engine_config(None))\n"
        "import cachegw.backend.core.engine\n"
    )
    mine = tmp_path / "mine"
    where, _ = _inductor_dirs(code, TORCHINDUCTOR_CACHE_DIR=str(mine), CACHEGW_CACHE_DIR=str(tmp_path))
    assert where == mine
