"""The built-in backend supervisor's process handling, with a stand-in child instead of the engine.

The child is Python's own ``http.server`` serving a directory with a ``health`` file, so /health answers
200 as the real backend's does; loading the real engine here would cost a minute and ~1 GB for nothing
this test checks (start, health wait, restart after a crash, stop)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cachegw.gateway.upstream.supervisor import BuiltinBackend
from testkit.servers import free_port


class StandInBackend(BuiltinBackend):
    def __init__(self, root: Path, port: int, exit_code: int | None = None, **kw) -> None:
        super().__init__("127.0.0.1", port, None, start_timeout_s=60.0, **kw)
        self.root, self.exit_code, self.spawned = root, exit_code, 0

    def _spawn(self) -> None:
        self.spawned += 1
        if self.exit_code is not None:
            cmd = [sys.executable, "-c", f"raise SystemExit({self.exit_code})"]
        else:
            cmd = [sys.executable, "-m", "http.server", str(self.port), "--bind", self.host]
            cmd += ["--directory", str(self.root)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "health").write_text("ok")
    return tmp_path


def test_url_names_the_v1_api() -> None:
    assert BuiltinBackend("127.0.0.1", 8123, None).url == "http://127.0.0.1:8123/v1"


async def test_start_waits_for_health_then_stop_ends_the_child(root: Path) -> None:
    b = StandInBackend(root, free_port())
    await b.start()
    try:
        async with httpx.AsyncClient() as c:
            assert (await c.get(f"http://127.0.0.1:{b.port}/health")).status_code == 200
    finally:
        await b.stop()
    assert b.proc is not None and b.proc.poll() is not None and b.restarts == 0


async def test_a_child_that_exits_at_start_is_an_error_naming_its_code(root: Path) -> None:
    b = StandInBackend(root, free_port(), exit_code=3)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        await b.start()


async def test_a_crashed_child_is_restarted(root: Path) -> None:
    b = StandInBackend(root, free_port())
    await b.start()
    try:
        first = b.proc
        assert first is not None
        first.kill()
        for _ in range(200):  # the watch polls each second, then backs off 2 s before the restart
            if b.restarts and b.proc is not first and b.proc is not None and b.proc.poll() is None:
                break
            await asyncio.sleep(0.1)
        assert b.restarts == 1 and b.spawned == 2
        async with httpx.AsyncClient() as c:
            for _ in range(100):
                try:
                    if (await c.get(f"http://127.0.0.1:{b.port}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    await asyncio.sleep(0.1)
            assert (await c.get(f"http://127.0.0.1:{b.port}/health")).status_code == 200
    finally:
        await b.stop()
