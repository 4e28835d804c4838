"""Runs the built-in engine as a child process and restarts it if it dies.

A separate process keeps the engine's CPU work (and any crash) away from the gateway's event
loop; the gateway reaches it over HTTP like any other backend.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time

import httpx

log = logging.getLogger("cachegw.gateway")


class BuiltinBackend:
    def __init__(self, host: str, port: int, config_path: str | None, start_timeout_s: float = 600.0) -> None:
        self.host, self.port, self.config_path = host, port, config_path
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._watch: asyncio.Task | None = None
        self._stopping = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def _spawn(self) -> None:
        cmd = [sys.executable, "-m", "gateway.cli", "backend", "--host", self.host, "--port", str(self.port)]
        if self.config_path:
            cmd += ["--config", self.config_path]
        log.info("starting the built-in backend: %s", " ".join(cmd))
        self.proc = subprocess.Popen(cmd)

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
        self._spawn()
        await self._wait_healthy()
        log.info("built-in backend ready at %s", self.url)
        self._watch = asyncio.create_task(self._keep_alive(), name="cachegw-backend-supervisor")

    async def _keep_alive(self) -> None:
        while not self._stopping:
            await asyncio.sleep(1.0)
            if self.proc is not None and self.proc.poll() is not None and not self._stopping:
                self.restarts += 1
                log.error(
                    "the built-in backend died (code %s): restart %d", self.proc.returncode, self.restarts
                )
                await asyncio.sleep(min(30.0, 2.0**self.restarts))
                self._spawn()
                try:
                    await self._wait_healthy()
                except RuntimeError:
                    log.exception("restart failed")

    async def stop(self) -> None:
        self._stopping = True
        if self._watch:
            self._watch.cancel()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
