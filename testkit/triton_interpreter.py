"""Triton's CPU interpreter for the kernel tests: working under numpy 2.4 and later, and a script run
in a fresh interpreter process.

The interpreter (Triton 3.4-3.6) turns a scalar tensor into a Python int with ``int(array)``; its
scalars are one-element arrays, and numpy 2.4 refuses ``int()`` of those, so every kernel with a loop
over tensor bounds (the paged-attention kernels) fails there. ``patch()`` makes that conversion read
the element instead. Tests call it before running a kernel in the interpreter; compiled kernels on a
GPU never go through this code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def patch() -> None:
    """Idempotent; does nothing where triton is not installed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "cachegw_patched", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched.cachegw_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def run_script(script: str, *args: str) -> dict[str, Any]:
    """``script`` (Python source, given ``args``) in a fresh process from the repository root, the
    kernels natively on CUDA and in Triton's interpreter elsewhere (its flag only takes effect before
    triton is first imported, hence the process); its last line of output read as JSON."""
    import torch

    env = {**os.environ, "HF_HUB_OFFLINE": "1"} | (
        {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
