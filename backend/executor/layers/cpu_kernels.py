"""Builds and loads ``cpu_kernels.cpp`` (block-quantized linear layers and paged decode attention
for AVX-512 VNNI CPUs).

The library is compiled once per machine with the system's g++ against the installed torch
(``-march=native``: it uses this CPU's instructions) and cached under
``$CACHEGW_KERNEL_CACHE`` (default ``~/.cache/cachegw/kernels``), keyed by the source, the torch
version, the compiler and the CPU's flags. ``load()`` says whether the ops are usable; when they are
not (no compiler, no VNNI, a failed build) the engine keeps torch's own kernels, and the log says why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("cachegw.backend")

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")


@dataclass(frozen=True)
class KernelStatus:
    available: bool
    reason: str  # why not, or where the library is


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _cache_dir() -> Path:
    return Path(os.environ.get("CACHEGW_KERNEL_CACHE") or Path.home() / ".cache" / "cachegw" / "kernels")


def _compile_command(compiler: str, out: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib_dirs = cpp_extension.library_paths()
    return [
        compiler,
        "-O3",
        "-march=native",
        "-std=c++17",
        "-fPIC",
        "-shared",
        "-fopenmp",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *includes,
        str(SOURCE),
        "-o",
        str(out),
        *[f"-L{d}" for d in lib_dirs],
        *[f"-Wl,-rpath,{d}" for d in lib_dirs],
        "-lc10",
        "-ltorch_cpu",
    ]


def _build(compiler: str, target: Path) -> None:
    """Compile into a temporary file, then rename: concurrent builders never load half a library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run(_compile_command(compiler, out), capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-2000:])
        os.replace(out, target)


@functools.cache
def load() -> KernelStatus:
    """Build (first time on a machine, about 8 s) and load the kernels; cached per process."""
    missing = [f for f in _REQUIRED_FLAGS if f not in _cpu_flags()]
    if missing:
        return KernelStatus(False, f"the CPU lacks {', '.join(missing)}")
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return KernelStatus(False, "no C++ compiler (install g++)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), version.encode(), sys.version.encode()):
        key.update(part)
    key.update(" ".join(sorted(_cpu_flags())).encode())
    target = _cache_dir() / f"cachegw_cpu_kernels_{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            log.info("building cachegw's CPU kernels into %s", target)
            _build(compiler, target)
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("cachegw's CPU kernels are unavailable, using torch's: %s", exc)
        return KernelStatus(False, f"build or load failed: {exc}")
    if not torch.ops.cachegw.has_vnni():
        return KernelStatus(False, "the compiler did not target AVX-512 VNNI")
    torch.library.register_fake("cachegw::block_linear", _block_linear_shape)
    torch.library.register_fake("cachegw::paged_decode_attention", _attention_shape)
    return KernelStatus(True, str(target))


def _block_linear_shape(
    x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int
) -> torch.Tensor:
    """What torch.compile traces the op as: [rows of x, rows of w], float32."""
    return x.new_empty(x.shape[0], w.shape[0])


def _attention_shape(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    return torch.empty_like(q)
