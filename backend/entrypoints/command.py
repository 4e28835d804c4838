"""The `cachegw backend` command: settle the engine's threads, then load it and serve.

Torch-free until the threads are settled: OpenMP reads its environment (the wait policy) once, when
torch first runs in parallel, and threads inherit the cores of the thread that starts them."""

from __future__ import annotations

import logging
import os

from cachegw.backend.config import EngineConfig, load_engine_config
from cachegw.backend.executor import cpu_threads


def main(
    config_path: str | None,
    host: str | None,
    port: int | None,
    model: str | None,
    cpus: str | None,
    quantization: str | None = None,
    role: str | None = None,
    prefill_url: str | None = None,
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_engine_config(
        config_path, model=model, cpus=cpus, quantization=quantization, role=role, prefill_url=prefill_url
    )
    use_inductor_cache(cfg)
    threads = cpu_threads.plan(cfg, frozenset(os.sched_getaffinity(0)))
    cpu_threads.apply(threads)

    from cachegw.backend.entrypoints.server import run_backend

    run_backend(cfg, config_path, host, port, threads)


def use_inductor_cache(cfg: EngineConfig) -> None:
    """Inductor's compile cache under ``[engine] cache_dir`` (``inductor/``), named before torch reads
    it (its config, once imported, has settled the folder); a TORCHINDUCTOR_CACHE_DIR the user set wins."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cfg.resolved_cache_dir / "inductor"))
