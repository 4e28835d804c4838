"""Host memory the engine reserves without occupying it until used.

The CPU KV cache is sized by ``[engine] kv_cache_bytes`` (1 GiB by default), but a server answering a
few short requests touches a few of its blocks. ``torch.zeros`` writes every page at start-up, so
the whole pool would count against the machine from the first second. Anonymous mappings from the
kernel read as zeros already, and a page takes memory only when first written: the pool grows into
its budget as blocks are filled, and never past it.

Start-up steps that parse or convert (the tokenizer's JSON, the weights' blocks) free their working
memory into the C heap between pages still in use; large allocations after them are mapped on their
own and never reuse it, so those pages would stay resident. ``release_free_heap`` hands them back.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
from collections.abc import Callable

import torch


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose pages are allocated when first written (CPU); ``torch.zeros`` elsewhere."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # private and anonymous: zero-filled by the kernel, unmapped when the tensor's storage is freed
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``; elsewhere nothing):
    about 14 MiB after the tokenizer loads, 11 MiB after the weights."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
