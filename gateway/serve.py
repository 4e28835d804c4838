"""`cachegw serve`: split the cores, open the database, and serve the parts ``gateway/compose.py``
builds under uvicorn (with the metrics listener on its own port when configured)."""

from __future__ import annotations

import asyncio
import logging
import os

import uvicorn
from fastapi import FastAPI

from cachegw.configtools.cpus import format_cpus
from cachegw.gateway.api.app import build_app
from cachegw.gateway.api.metrics_http import metrics_app
from cachegw.gateway.compose import started_gateway
from cachegw.gateway.config import Settings
from cachegw.gateway.storage.store import Store
from cachegw.gateway.upstream.supervisor import CoreSplit, split_cores

log = logging.getLogger("cachegw.gateway")


def run_gateway(settings: Settings) -> None:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # httpx logs every request it sends at INFO: with health probes, a line per backend every few
    # seconds. Failures are logged by the gateway itself; uvicorn's access log shows the requests.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # One-query embeddings are tiny: extra OpenMP threads only spin against the event loop (a
    # single-sentence encode took 80-260 ms with 2 threads on a busy 2-core machine, 13 ms with 1).
    torch.set_num_threads(settings.cache.encoder.threads)
    cores = CoreSplit(None, None)
    if not settings.gateway.backends:  # the gateway and its engine share this machine: split its cores
        cores = split_cores(settings.engine.cpus, frozenset(os.sched_getaffinity(0)))
    if cores.gateway is not None:  # before any worker thread starts: they inherit it
        os.sched_setaffinity(0, cores.gateway)
        log.info(
            "gateway on cores %s, the built-in engine on %s", *map(format_cpus, (cores.gateway, cores.engine))
        )
    # a database that cannot be opened stops the start with one line, not a lifespan traceback
    Store(settings.gateway.resolved_database_url(settings.data_dir)).close()
    app = build_app(lambda: started_gateway(settings, engine_cpus=cores.engine))
    g = settings.gateway
    log.info("gateway on http://%s:%d/v1 (data in %s)", g.host, g.port, settings.data_dir)
    log.info("dashboard on http://%s:%d/admin (admin token: see docs/admin.md)", g.host, g.port)
    if not g.metrics_port:
        uvicorn.run(app, host=g.host, port=g.port, log_config=None, log_level=None)  # gateway/logs.py
        return
    log.info("metrics on http://%s:%d/metrics only", g.metrics_host, g.metrics_port)
    asyncio.run(serve_with_metrics(app, settings))


async def serve_with_metrics(app: FastAPI, settings: Settings) -> None:
    """The gateway and its metrics listener in one process and loop; when one stops, so does the other.

    Each server catches SIGINT/SIGTERM while it runs and hands the signal on when it returns (uvicorn
    re-raises it), so a stop signal ends both."""
    g = settings.gateway
    main = uvicorn.Server(uvicorn.Config(app, host=g.host, port=g.port, log_config=None, log_level=None))
    side = metrics_app(app.state.parts)
    metrics = uvicorn.Server(
        # log_config None: a second logging setup would silence the main server's log
        uvicorn.Config(side, host=g.metrics_host, port=g.metrics_port, lifespan="off", log_config=None)
    )
    tasks = [asyncio.create_task(main.serve()), asyncio.create_task(metrics.serve())]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    main.should_exit = metrics.should_exit = True
    await asyncio.gather(*tasks)
