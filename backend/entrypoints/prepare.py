"""Ready this machine for a fast first start: `make prepare` (run by `make serve` and `make backend`).

A first `cachegw backend` on a new machine builds cachegw's CPU kernels (g++), writes the model's
config and tokenizer, and, where the fused decode step does not run (float weights, bfloat16, other
families), compiles its decode step (Inductor, minutes of one core the first time) while it serves
eagerly. This does the same work once, ahead, into the same caches under
``[engine] cache_dir``, with the engine settings of config.toml (or ``--config``), so the server's
first start finds them warm: it serves at once and reaches its compiled speed after the tracing only.

    python -m cachegw.backend.entrypoints.prepare [--config config.toml]
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from cachegw.backend.config import load_engine_config
from cachegw.backend.entrypoints.command import use_inductor_cache
from cachegw.backend.executor import cpu_threads

log = logging.getLogger("cachegw.backend")


def main(config_path: str | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_engine_config(config_path)
    use_inductor_cache(cfg)
    threads = cpu_threads.plan(cfg, frozenset(os.sched_getaffinity(0)))
    cpu_threads.apply(threads)
    start = time.perf_counter()
    compile = "startup" if cfg.compile != "off" else "off"
    from cachegw.backend.core.engine import LLMEngine

    cpu_threads.set_threads(threads)
    engine = LLMEngine(cfg.with_overrides(compile=compile))
    compiled = engine.runner.compiled
    if compiled is not None and compiled.failed:
        log.warning("the decode step did not compile (%s): the server will decode eagerly", compiled.failed)
    log.info("prepared in %.0f s: the engine's caches under %s are warm", time.perf_counter() - start,
             cfg.resolved_cache_dir)  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="config.toml to read [engine] from")
    main(ap.parse_args().config)
