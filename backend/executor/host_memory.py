"""Host memory the engine reserves without occupying it until used.

The CPU KV cache is sized by ``[engine] kv_cache_bytes`` (1 GiB by default), but a server answering a
few short requests touches a few of its blocks. ``torch.zeros`` writes every page at start-up, so
the whole pool would count against the machine from the first second. Anonymous mappings from the
kernel read as zeros already, and a page takes memory only when first written: the pool grows into
its budget as blocks are filled, and never past it.
"""

from __future__ import annotations

import math
import mmap

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
