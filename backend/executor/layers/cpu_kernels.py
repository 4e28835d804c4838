"""Builds and loads ``cpu_kernels.cpp`` (block-quantized linear layers and paged decode attention
for x86 CPUs), once per instruction set: ``avx512`` (AVX-512 VNNI), ``avxvnni`` (AVX2 with the
256-bit VNNI of newer client CPUs) and ``avx2`` (any AVX2 CPU: Zen 2/3, Haswell on).

Each build is compiled once per machine with the system's g++ against the installed torch and cached
under ``$CACHEGW_KERNEL_CACHE`` (default ``~/.cache/cachegw/kernels``), keyed by the sources, the
build's flags, the torch version, the compiler and the CPU's flags. Each registers its ops in its own
namespace (``torch.ops.cachegw_avx2`` ...), so several load in one process (the tests run every
build this CPU can). ``choose`` applies ``[engine] cpu_kernels``: ``auto`` takes the best build the
CPU has (torch's kernels where none builds, and the log says why); a named build the CPU lacks is
refused at start.
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
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("cachegw.backend")

SOURCES = tuple(
    Path(__file__).with_name(n)
    for n in (
        "cpu_kernels.cpp",
        "cpu_kernels_avx512.h",
        "cpu_kernels_avx512_attention.h",
        "cpu_kernels_avx2.h",
        "cpu_kernels_prefill.h",
        "cpu_kernels_decode.h",
        "cpu_kernels_modules.h",
    )
)
SETTINGS = ("auto", "avx512", "avxvnni", "avx2", "torch")


@dataclass(frozen=True)
class Build:
    name: str
    needs: tuple[str, ...]  # /proc/cpuinfo flags
    flags: tuple[str, ...]  # g++'s target options


# best first: what "auto" tries
BUILDS = {
    "avx512": Build("avx512", ("avx512f", "avx512bw", "avx512_vnni"), ("-march=native",)),
    # x86-64-v3: AVX2, FMA, F16C (and no AVX-512 even on a CPU that has it)
    "avxvnni": Build(
        "avxvnni", ("avx2", "fma", "f16c", "avx_vnni"), ("-march=x86-64-v3", "-mavxvnni", "-mtune=native")
    ),
    "avx2": Build("avx2", ("avx2", "fma", "f16c"), ("-march=x86-64-v3", "-mtune=native")),
}


@dataclass(frozen=True)
class KernelStatus:
    available: bool
    reason: str  # why not, or where the library is
    build: str = ""  # which build ("avx512", "avxvnni", "avx2") when available

    @property
    def ops(self) -> str:
        """The op namespace: ``getattr(torch.ops, status.ops).block_linear``."""
        return f"cachegw_{self.build}"


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


def _compile_command(compiler: str, build: Build, out: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib_dirs = cpp_extension.library_paths()
    return [
        compiler,
        "-O3",
        # no fused multiply-adds but the written ones: every build then rounds alike, bit for bit
        "-ffp-contract=off",
        *build.flags,
        f"-DCACHEGW_OPS=cachegw_{build.name}",
        "-std=c++17",
        "-fPIC",
        "-shared",
        "-fopenmp",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *includes,
        str(SOURCES[0]),
        "-o",
        str(out),
        *[f"-L{d}" for d in lib_dirs],
        *[f"-Wl,-rpath,{d}" for d in lib_dirs],
        "-lc10",
        "-ltorch_cpu",
    ]


def _build(compiler: str, build: Build, target: Path) -> None:
    """Compile into a temporary file, then rename: concurrent builders never load half a library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run(
            _compile_command(compiler, build, out), capture_output=True, text=True, timeout=600
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-2000:])
        os.replace(out, target)


def load(name: str = "avx512") -> KernelStatus:
    """One build, where the CPU has its instructions: built the first time on a machine (about 8 s)
    and loaded once per process."""
    missing = [f for f in BUILDS[name].needs if f not in _cpu_flags()]
    if missing:
        return KernelStatus(False, f"the CPU lacks {', '.join(missing)}")
    return _load(name)


_LOADING = threading.Lock()  # one build at a time: the engine may start one in a thread at start-up


def _load(name: str) -> KernelStatus:
    with _LOADING:
        return _load_once(name)


@functools.cache
def _load_once(name: str) -> KernelStatus:
    build = BUILDS[name]
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return KernelStatus(False, "no C++ compiler (install g++)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256()
    for part in (
        *(s.read_bytes() for s in SOURCES),
        torch.__version__.encode(),
        version.encode(),
        sys.version.encode(),
    ):
        key.update(part)
    key.update(" ".join([*build.flags, *sorted(_cpu_flags())]).encode())
    target = _cache_dir() / f"cachegw_cpu_kernels_{name}_{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            log.info("building cachegw's CPU kernels (%s) into %s", name, target)
            _build(compiler, build, target)
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("cachegw's %s CPU kernels are unavailable: %s", name, exc)
        return KernelStatus(False, f"build or load failed: {exc}")
    status = KernelStatus(True, str(target), name)
    built_for = getattr(torch.ops, status.ops).isa()
    if built_for != name:
        return KernelStatus(False, f"the compiler targeted {built_for}, not {name}")
    torch.library.register_fake(f"{status.ops}::block_linear", _block_linear_shape)
    torch.library.register_fake(f"{status.ops}::paged_decode_attention", _attention_shape)
    return status


def choose(setting: str) -> KernelStatus:
    """The kernels ``[engine] cpu_kernels`` asks for: "auto" the first build of ``BUILDS`` this CPU
    has and g++ builds (unavailable, with the reasons, where none does: torch's kernels then run);
    "torch" none; a named build must load, else ValueError says why."""
    if setting not in SETTINGS:
        raise ValueError(f"[engine] cpu_kernels must be one of {', '.join(SETTINGS)}, not {setting!r}")
    if setting == "torch":
        return KernelStatus(False, 'cpu_kernels = "torch"')
    if setting != "auto":
        status = load(setting)
        if not status.available:
            raise ValueError(
                f'[engine] cpu_kernels = "{setting}" cannot run here: {status.reason} '
                '("auto" picks the best this CPU has, "torch" runs torch\'s kernels)'
            )
        return status
    reasons = []
    for name in BUILDS:
        status = load(name)
        if status.available:
            return status
        reasons.append(f"{name}: {status.reason}")
    return KernelStatus(False, "; ".join(reasons))


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
