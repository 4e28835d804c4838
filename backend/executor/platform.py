"""Which device and dtype to run on when the config says "auto"."""

from __future__ import annotations

import functools

import torch

from cachegw.backend.config import EngineConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def cpu_has_amx() -> bool:
    """AMX tiles make bf16 matmuls about 3x faster than float32 on this kind of CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but no CUDA GPU is available")
    return device


def resolve_dtype(name: str, device: torch.device, block_weights: bool = False) -> torch.dtype:
    """``auto``: bfloat16 on CUDA and on CPUs with AMX, float32 elsewhere and wherever the projections
    run on cachegw's block kernels (``block_weights``: they take float32 activations, and the fused
    decode step, ``executor/fused_decode.py``, needs float32; bfloat16 would only add casts)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda" or (cpu_has_amx() and not block_weights):
        return torch.bfloat16
    return torch.float32


def block_weights(config: EngineConfig, gguf: object, device: torch.device) -> bool:
    """Whether the projections will run on cachegw's block kernels: a CPU, quantized weights (int4/int8,
    or a GGUF's under ``auto``) and kernels that build here. ``gguf``: the model's GGUF file, or None."""
    if device.type != "cpu" or config.quantization == "none" or config.cpu_kernels == "torch":
        return False
    if config.quantization == "auto" and gguf is None:
        return False
    from cachegw.backend.executor.layers import cpu_kernels

    return cpu_kernels.choose(config.cpu_kernels).available
