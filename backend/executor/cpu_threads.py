"""Where the engine's compute threads run: on which cores, how many, and how they wait.

torch's OpenMP threads meet at a barrier after every operator, thousands of times per decode step of
a small model. When another process holds one of their cores, the threads that spin at the barrier
wait for the one that is descheduled, and every operator pays for it: on 2 cores, batch-1 decode at
2 threads fell to 0.27 of its quiet speed beside one busy process, while 1 thread kept 0.99 and 2
threads with passive waiting 1.07 of their own, lower, quiet speed (docs/benchmarks.md, "The engine
beside other work"). So the engine's process settles its threads before torch starts any: the cores
it may use (`os.sched_getaffinity`, narrowed by `[engine] cpus`), one thread per core unless
`[engine] threads` says otherwise, and OpenMP's wait policy (`[engine] omp_wait_policy`). OpenMP reads
its environment once, when torch first runs in parallel, so `apply` must run before that: the
`cachegw backend` command calls it first thing.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

from cachegw.backend.config import EngineConfig
from cachegw.configtools.cpus import format_cpus, parse_cpus

log = logging.getLogger("cachegw.backend")


@dataclass(frozen=True)
class ThreadPlan:
    cpus: frozenset[int]
    threads: int
    wait_policy: str  # "ACTIVE" | "PASSIVE" | "" (the OpenMP runtime's own: spin a while, then sleep)


def plan(cfg: EngineConfig, available: frozenset[int]) -> ThreadPlan:
    """The engine's cores (those it may use, narrowed by a list in ``cfg.cpus``), its threads (one per core
    unless set) and the wait policy. ``auto`` is passive with more than one thread: spinning threads
    beside any other busy process lost 3-4x (float32 and int4), passive waiting lost nothing on float32
    and a third on int4 SmolLM2 (the smallest operators) on a quiet machine; "active" or "runtime"
    (OpenMP's own: spin a while, then sleep) suit cores nothing else ever uses."""
    cpus = available if cfg.cpus in ("auto", "all") else parse_cpus(cfg.cpus) & available
    if not cpus:
        raise ValueError(f"[engine] cpus = {cfg.cpus!r} names none of the cores this process may use "
                         f"({format_cpus(available)})")  # fmt: skip
    threads = cfg.threads or len(cpus)
    wait = {"active": "ACTIVE", "passive": "PASSIVE", "runtime": ""}.get(cfg.omp_wait_policy)
    if wait is None:  # auto: a lone thread never waits at a barrier; several must not spin
        wait = "PASSIVE" if threads > 1 else ""
    return ThreadPlan(frozenset(cpus), threads, wait)


def apply(p: ThreadPlan) -> None:
    """Pin this process to the plan's cores and set the wait policy; call before torch runs anything
    in parallel (``set_threads`` then sets the count once torch is imported)."""
    if p.cpus != frozenset(os.sched_getaffinity(0)):
        os.sched_setaffinity(0, p.cpus)
    if p.wait_policy:
        os.environ["OMP_WAIT_POLICY"] = p.wait_policy
    log.info(
        "engine threads: %d on cores %s, OpenMP wait policy %s",
        p.threads,
        format_cpus(p.cpus),
        p.wait_policy.lower() or "default",
    )


def set_threads(p: ThreadPlan) -> None:
    import torch

    torch.set_num_threads(p.threads)


def settle_for_script(cfg: EngineConfig) -> ThreadPlan:
    """The same settling for an engine built in a script (``LLM()``), where torch may be loaded already.

    GNU OpenMP (torch's) reads OMP_WAIT_POLICY once, when torch is imported: a script that imported
    torch before building its ``LLM`` keeps spinning threads, so it is told how to avoid that (the
    cores and the thread count are still set)."""
    p = plan(cfg, frozenset(os.sched_getaffinity(0)))
    late = "torch" in sys.modules and os.environ.get("OMP_WAIT_POLICY", "").upper() != p.wait_policy
    if late and p.wait_policy and not _on_gpu(cfg.device):
        log.warning(
            "torch was imported before LLM(): its OpenMP threads keep their default waiting (spinning, "
            "which loses most of the engine's speed beside other busy processes). Set OMP_WAIT_POLICY=%s "
            "in the environment, or build the LLM before importing torch.",
            p.wait_policy,
        )
    apply(p)
    set_threads(p)
    return p


def _on_gpu(device: str) -> bool:
    """A GPU engine's steps do not wait on OpenMP threads: the warning above does not concern it."""
    import torch  # already imported where this is asked

    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
