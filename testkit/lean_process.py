"""Which heavy modules a fresh interpreter imports to run some engine code: the serving process should
import neither transformers nor Dynamo (tests/test_lean_*.py, tests/test_model_config_families.py)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

_REPORT = (
    "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers' or 'torch._dynamo' in m))\n"
)


def heavy_imports(body: str, cache_dir: Path | None = None) -> list[str]:
    """Run ``body`` (Python source; ``sys`` is imported) in a new interpreter, with ``CACHEGW_CACHE_DIR``
    set to ``cache_dir`` when given; the transformers and Dynamo modules it left imported. A failing
    ``body`` fails the calling test with its stderr."""
    env = {**os.environ, "CACHEGW_CACHE_DIR": str(cache_dir)} if cache_dir is not None else None
    done = subprocess.run(
        [sys.executable, "-c", "import sys\n" + body + _REPORT],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return list(ast.literal_eval(done.stdout.strip().splitlines()[-1]))
