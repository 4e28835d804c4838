"""How many programs split a decode's KV range on CUDA (flash-decoding), from Python ints alone.

Kept apart from the Triton kernels (``triton_attention.py``) so the choice is plain Python: it never
reads a tensor's values, so the decode path can still be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch

from cachegw.backend.executor.layers.attention import AttentionMetadata


def default_splits(
    meta: AttentionMetadata, programs: int, block_n: int, device: torch.device, window: int | None = None
) -> int:
    """Split the KV range only for decode-only batches too small to fill the GPU.

    Uses Python ints only (batch shape, SM count, ``meta.max_seq_len``), so it never syncs. Each
    split keeps at least two KV tiles of work; the answer is rounded down to a power of two.
    """
    if meta.max_query_len != 1 or device.type != "cuda":
        return 1
    span = min(meta.max_seq_len, window or meta.max_seq_len)  # a decode reads at most its window
    want = min(2 * sm_count(device) // programs, -(-span // (2 * block_n)), 32)
    return 1 << (want.bit_length() - 1) if want > 1 else 1


@functools.cache
def sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count
