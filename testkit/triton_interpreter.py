"""Triton's CPU interpreter under numpy 2.4 and later, for the kernel tests.

The interpreter (Triton 3.4-3.6) turns a scalar tensor into a Python int with ``int(array)``; its
scalars are one-element arrays, and numpy 2.4 refuses ``int()`` of those, so every kernel with a loop
over tensor bounds (the paged-attention kernels) fails there. ``patch()`` makes that conversion read
the element instead. Tests call it before running a kernel in the interpreter; compiled kernels on a
GPU never go through this code.
"""

from __future__ import annotations

from typing import Any


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
