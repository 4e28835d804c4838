"""Runs the built-in engine as a child process and restarts it if it dies or hangs.

A separate process keeps the engine's CPU work (and any crash) away from the gateway's event
loop; the gateway reaches it over HTTP like any other backend. The port must be free before the
child starts, so the gateway never takes another server for its engine. A child that stops
answering /health (stopped, deadlocked) is killed and restarted; the restart delay doubles with
each failure in a row and starts over once a child has stayed healthy for a while.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from cachegw.configtools.cpus import format_cpus, parse_cpus

log = logging.getLogger("cachegw.gateway")

MAX_RESTART_DELAY_S = 30.0


def restart_delay(failures: int) -> float:
    """Seconds to wait before restart number ``failures`` of a row: 2, 4, 8, 16, then 30."""
    return min(MAX_RESTART_DELAY_S, 2.0**failures)


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now (SO_REUSEADDR, as uvicorn binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class CoreSplit:
    """The cores of the gateway's process and of its built-in engine (None: no change)."""

    gateway: frozenset[int] | None
    engine: frozenset[int] | None


def split_cores(setting: str, available: frozenset[int]) -> CoreSplit:
    """``[engine] cpus`` under `cachegw serve`: "auto" gives the engine every core but the first and keeps
    that one for the gateway (HTTP, embeddings, verifier, SQL), when there are at least two, so the
    two never stall each other's threads; "all" shares every core; a CPU list gives the engine those
    cores and the gateway the rest (all of them if none is left)."""
    if setting == "all" or (setting == "auto" and len(available) < 2):
        return CoreSplit(None, None)
    if setting == "auto":
        first = min(available)
        return CoreSplit(frozenset({first}), available - {first})
    engine = parse_cpus(setting) & available
    if not engine:
        raise ValueError(
            f"[engine] cpus = {setting!r} names none of the cores this process may use "
            f"({format_cpus(available)})"
        )
    return CoreSplit(available - engine or None, engine)


class BuiltinBackend:
    def __init__(
        self,
        host: str,
        port: int,
        config_path: str | None,
        cpus: frozenset[int] | None = None,
        start_timeout_s: float = 600.0,
        *,
        probe_interval_s: float = 5.0,
        probe_timeout_s: float = 5.0,
        hung_after_probes: int = 3,
        healthy_reset_s: float = 60.0,
        stop_timeout_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host, self.port, self.config_path = host, port, config_path
        self.cpus = cpus  # the child's cores (it settles its threads on them), or the gateway's own
        self.start_timeout_s = start_timeout_s
        self.probe_interval_s, self.probe_timeout_s = probe_interval_s, probe_timeout_s
        self.hung_after_probes, self.healthy_reset_s = hung_after_probes, healthy_reset_s
        self.clock = clock
        self.stop_timeout_s = stop_timeout_s  # SIGTERM to SIGKILL: the engine writes its KV tier meanwhile
        self.proc: subprocess.Popen | None = None
        self.restarts = 0  # over the gateway's life (a metric)
        self.failures = 0  # in a row: sets the next restart's delay
        self.healthy_since: float | None = None
        self._watch: asyncio.Task | None = None
        self._stopping = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def _check_port(self) -> None:
        if not port_is_free(self.host, self.port):
            raise RuntimeError(
                f"port {self.port} on {self.host} is in use: the built-in backend cannot start there "
                "(set [backend_server] port to a free port, or stop what listens on it)"
            )

    def _spawn(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "cachegw.gateway.cli",
            "backend",
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        if self.config_path:
            cmd += ["--config", self.config_path]
        log.info("starting the built-in backend: %s", " ".join(cmd))
        # The child starts on its own cores (not the one the gateway pinned itself to) and settles
        # one thread per core of its affinity (backend/executor/cpu_threads.py).
        cores = self.cpus
        self.proc = subprocess.Popen(
            cmd, preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None
        )

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"the built-in backend exited with code {self.proc.returncode}")
                try:
                    if (await client.get(f"http://{self.host}:{self.port}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        raise RuntimeError(f"the built-in backend did not become healthy in {self.start_timeout_s:.0f} s")

    async def start(self) -> None:
        self._check_port()
        self._spawn()
        await self._wait_healthy()
        self.healthy_since = self.clock()
        log.info("built-in backend ready at %s", self.url)
        self._watch = asyncio.create_task(self._keep_alive(), name="cachegw-backend-supervisor")

    async def probe(self, client: httpx.AsyncClient) -> bool:
        """One health check of the child: does it answer /health with 200 in time?"""
        try:
            r = await client.get(f"http://{self.host}:{self.port}/health", timeout=self.probe_timeout_s)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    def note_healthy(self) -> None:
        """A child healthy for ``healthy_reset_s`` wipes the failure count: the next crash waits 2 s."""
        if self.healthy_since is not None and self.clock() - self.healthy_since >= self.healthy_reset_s:
            self.failures = 0

    async def _keep_alive(self) -> None:
        missed = 0
        async with httpx.AsyncClient() as client:
            while not self._stopping:
                await asyncio.sleep(self.probe_interval_s)
                if self._stopping or self.proc is None:
                    return
                if self.proc.poll() is not None:
                    why = f"died (code {self.proc.returncode})"
                elif await self.probe(client):
                    missed = 0
                    self.note_healthy()
                    continue
                else:
                    missed += 1
                    if missed < self.hung_after_probes:
                        continue
                    why = f"stopped answering /health ({missed} probes)"
                    self.proc.kill()
                    await asyncio.to_thread(self.proc.wait)
                missed = 0
                await self._restart(why)

    async def _restart(self, why: str) -> None:
        self.restarts += 1
        self.failures += 1
        self.healthy_since = None
        delay = restart_delay(self.failures)
        log.error("the built-in backend %s: restart %d in %.0f s", why, self.restarts, delay)
        await asyncio.sleep(delay)
        try:
            self._check_port()
            self._spawn()
            await self._wait_healthy()
            self.healthy_since = self.clock()
        except RuntimeError:
            log.exception("restart failed")

    async def stop(self) -> None:
        self._stopping = True
        if self._watch:
            self._watch.cancel()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
