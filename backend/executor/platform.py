"""Which device and dtype to run on when the config says "auto"."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

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


def block_weights(config: EngineConfig, gguf: object, device: torch.device) -> Callable[[], bool]:
    """Whether the projections will run on cachegw's block kernels: a CPU, quantized weights (int4/int8,
    or a GGUF's under ``auto``) and kernels that build here. ``gguf``: the model's GGUF file, or None.

    The kernels are loaded (built with g++ the first time on a machine: seconds of a core) in a thread
    started here, so the caller can write the model's config and tokenizer meanwhile; the returned
    callable waits for them. A build that fails there says so again when the runner asks for it."""
    if device.type != "cpu" or config.quantization == "none" or config.cpu_kernels == "torch":
        return lambda: False
    if config.quantization == "auto" and gguf is None:
        return lambda: False
    from cachegw.backend.executor.layers import cpu_kernels

    found: list[bool] = []

    def load() -> None:
        try:
            found.append(cpu_kernels.choose(config.cpu_kernels).available)
        except ValueError:  # a build the CPU lacks: the runner refuses it with this message
            found.append(False)

    thread = threading.Thread(target=load, name="cpu-kernels", daemon=True)
    thread.start()

    def available() -> bool:
        thread.join()
        return bool(found and found[0])

    return available
