"""Which Triton kernels a model runs on CUDA: the paged attention and the fused element-wise parts.

Each is chosen once, at start-up, after a self-check on the model's own shapes against the torch code
on the same device, so a kernel that does not compile or misbehaves on some GPU falls back to torch's
instead of serving wrong tokens. Triton is imported only here and only on CUDA.
"""

from __future__ import annotations

import logging

import torch

from cachegw.backend.executor.layers.attention import PagedAttention

log = logging.getLogger("cachegw.backend")


def choose_attention(
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    spec,
    block_size: int,
    kv_storage: torch.dtype,
    torch_only: str | None,
) -> str:
    """ "triton" on CUDA when the kernels pass their self-check, else "torch"; the model's attention
    layers are told. ``torch_only``: why this model needs the torch path (None when it does not)."""
    use = False
    if device.type == "cuda" and torch_only:
        log.warning("%s: torch attention path, no CUDA graphs", torch_only)
    elif device.type == "cuda":
        from cachegw.backend.executor.layers.kernel_check import self_check
        from cachegw.backend.executor.layers.triton_attention import triton_available

        try:
            use = triton_available() and self_check(device, dtype, spec, block_size, kv_storage)
        except Exception:
            log.exception("Triton attention failed its self-check")
        if not use:
            log.warning("using the torch attention path on CUDA (slower; no CUDA graphs)")
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.use_triton = use
    return "triton" if use else "torch"


def enable_fused(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA: norms, rotary and SiLU as one Triton kernel each (``layers/triton_fused.py``)."""
    if device.type != "cuda":
        return False
    from cachegw.backend.executor.layers import triton_fused

    return triton_fused.enable(model, device, dtype)
