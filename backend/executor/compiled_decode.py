"""The decode step compiled by ``torch.compile`` (Inductor's C++ kernels on CPU), for models the fused
decode step (``fused_decode.py``: the same fusion by hand, nothing to compile) does not run: float
weights, bfloat16, other families.

A batch-1 decode step on CPU spends as long on the ~7,000 small ops around its matmuls (norms,
rotary, casts, masks, adds) and the Python that launches them as on the matmuls themselves.
Inductor fuses those ops into a few dozen generated C++ loops, called from a C++ wrapper; the
weight-only int4/int8 matmuls and the attention stay calls to their own kernels. Only steps made
of decodes alone take this path (prefill chunks keep the eager path, where the matmuls
dominate), traced with ``DecodeMetadata``'s tensors alone, so one graph serves every batch size
and context length.

Compiling takes a few minutes of one core the first time on a machine (building the C++ wrapper)
and 30-40 s at later starts (Inductor's disk cache, ``<[engine] cache_dir>/inductor``, spares the
builds, not the tracing). By default it runs in a background thread while the engine decodes
eagerly, and the engine switches when it is done; a failure (no C++ compiler, an unsupported op) is
logged and the engine stays eager. ``TORCH_COMPILE_DISABLE=1`` (torch's own switch) turns it off too.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import types
from pathlib import Path

# Inductor settles its cache folder when its config is first imported, writing it into
# TORCHINDUCTOR_CACHE_DIR (torch's default: under /tmp, emptied by a reboot): name ours first, unless
# the user (or `cachegw backend`, from [engine] cache_dir) already has.
_CACHE_DIR = Path.home() / ".cache" / "cachegw" / "inductor"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_CACHE_DIR))

import sys  # noqa: E402

import torch  # noqa: E402

from cachegw.backend.executor.layers.attention import AttentionMetadata, DecodeMetadata  # noqa: E402
from cachegw.backend.executor.models.llama import LlamaForCausalLM  # noqa: E402

log = logging.getLogger("cachegw.backend")

# Block tables are padded to at least this many columns, so that no width met later is 0 or 1,
# sizes torch.compile would otherwise specialise on.
_MIN_BLOCKS = 2
_instances = itertools.count()
# The generated loops run on one thread: at decode sizes each is a few microseconds of work, less
# than an OpenMP region's fork and barrier (with passive waiting, a wake-up each). Measured at 2
# threads, passive, int4, batch 1: 18.4 ms a step against 21.9 with the loops parallel (eager 27.7).
# The matmuls stay on torch's threads.
_KERNEL_THREADS = 1
# The graph's wrapper (the code calling each kernel) in C++ rather than Python: about 1 ms less a
# step at batch 1 (a few hundred calls of a few microseconds each). Building it takes minutes the
# first time; Inductor's cache keeps it, so the cache lives somewhere a reboot does not empty
# (_CACHE_DIR above).


class CompiledDecode:
    """Runs decode-only steps through one compiled graph of the model, once it is ready."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.ready = False
        self.failed: str | None = None
        self.compile_seconds = 0.0
        self.steps = 0  # decode steps served by the compiled graph
        self._forward = torch.compile(
            _own_code(self._eager),
            dynamic=True,
            fullgraph=True,
            # Guards on the weights would be checked at every step; they never change after load.
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )

    def _eager(self, ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMetadata) -> torch.Tensor:
        return self.model(ids, positions, meta)

    @staticmethod
    def decode_meta(meta: AttentionMetadata) -> DecodeMetadata:
        tables = meta.block_tables
        if tables.shape[1] < _MIN_BLOCKS:  # padding columns point at block 0, past every context
            tables = torch.nn.functional.pad(tables, (0, _MIN_BLOCKS - tables.shape[1]))
        return DecodeMetadata(meta.slot_mapping, tables, meta.seq_lens)

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Hidden states [B, hidden], or None while compiling or after a failure (run eagerly)."""
        if not self.ready:
            return None
        try:
            # A shape the graph does not cover would compile again for tens of seconds mid-serving.
            with torch.compiler.set_stance("fail_on_recompile"):
                hidden = self._forward(ids, positions, self.decode_meta(meta))
            self.steps += 1
            return hidden
        except Exception as exc:  # never let the fast path take the engine down
            self.ready, self.failed = False, f"{type(exc).__name__}: {exc}"
            log.exception("the compiled decode step failed: decoding eagerly from now on")
            return None

    def compile(self, block_size: int, scratch_block: int) -> None:
        """Traces and compiles with a two-sequence decode that writes only into ``scratch_block``."""
        start = time.perf_counter()
        dev = self.model.norm.weight.device
        try:
            import torch._inductor.config as inductor_config
            import torch.fx.experimental._config as fx_config

            # torch's config is per thread: whether to compile was decided by the thread that built
            # the engine (will_compile). Inside inference mode, as the engine's step inputs are made.
            with (
                torch._dynamo.config.patch(disable=False),
                inductor_config.patch({"cpp.threads": _KERNEL_THREADS, "cpp_wrapper": True}),
                fx_config.patch(backed_size_oblivious=True),  # type: ignore[attr-defined]
                torch.inference_mode(),
            ):
                first = scratch_block * block_size
                ids = torch.zeros(2, dtype=torch.long, device=dev)
                positions = torch.tensor([1, 2], device=dev)
                slots = torch.tensor([first, first + 1], device=dev)
                tables = torch.full((2, _MIN_BLOCKS), scratch_block, dtype=torch.int32, device=dev)
                lens = torch.tensor([2, 3], dtype=torch.int32, device=dev)
                # The batch size is unbacked (no 0/1 specialisation: batch 1 takes the same graph),
                # the table width dynamic, and size-oblivious reasoning keeps 1s out of the guards.
                for t in (ids, positions, slots, tables, lens):
                    torch._dynamo.decorators.mark_unbacked(t, 0)
                torch._dynamo.mark_dynamic(tables, 1)
                self._forward(ids, positions, DecodeMetadata(slots, tables, lens))
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("could not compile the decode step (%s): decoding eagerly", self.failed)
            return
        self.compile_seconds = time.perf_counter() - start
        self.ready = True
        log.info("compiled the decode step in %.1f s: decode-only steps run it", self.compile_seconds)


def _own_code(method):
    """The method as a function with a code object of its own.

    Dynamo keeps compiled graphs on the code object, and the guards that would tell two models
    apart are the ones skipped above: a second engine in the process would run the first one's
    graph on its own weights (another dtype, another shape). A copy of the code per instance keeps
    each engine's graph its own.
    """
    fn = method.__func__
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_instances)}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__)
    return types.MethodType(copy, method.__self__)


def _compile_disabled() -> bool:
    """torch's own switch, read without importing Dynamo (about 70 MiB and 1 s) when it is not loaded."""
    if "torch._dynamo" in sys.modules:
        return bool(torch._dynamo.config.disable)
    return os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1"


def will_compile(when: str) -> bool:
    """``[engine] compile`` is on and torch.compile is not disabled (TORCH_COMPILE_DISABLE=1)."""
    if when == "off":
        return False
    if _compile_disabled():
        log.info("torch.compile is disabled (TORCH_COMPILE_DISABLE): decoding eagerly")
        return False
    return True


def start_compiling(model: LlamaForCausalLM, block_size: int, scratch: int, when: str) -> CompiledDecode:
    """``when``: "startup" compiles before returning, "background" in a daemon thread."""
    compiled = CompiledDecode(model)
    if when == "startup":
        compiled.compile(block_size, scratch)
    else:
        threading.Thread(
            target=compiled.compile, args=(block_size, scratch), name="compile-decode", daemon=True
        ).start()
    return compiled
