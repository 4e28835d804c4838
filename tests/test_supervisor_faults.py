"""The supervisor's fault handling: a busy port, a hung child, and a restart delay that starts over.

The child is the stand-in of test_supervisor_unit (Python's http.server answering /health): a hang is
caused with SIGSTOP, which the real engine would meet the same way, without a minute of model load."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

import pytest

from cachegw.gateway.upstream.supervisor import BuiltinBackend, port_is_free, restart_delay
from testkit.servers import free_port
from tests.test_supervisor_unit import StandInBackend, root  # noqa: F401


def test_the_restart_delay_doubles_then_stays_at_its_cap() -> None:
    assert [restart_delay(n) for n in range(1, 8)] == [2, 4, 8, 16, 30, 30, 30]


def test_the_failure_count_starts_over_after_a_healthy_period() -> None:
    now = [1000.0]
    b = BuiltinBackend("127.0.0.1", 1, None, healthy_reset_s=60.0, clock=lambda: now[0])
    b.failures, b.healthy_since = 5, 1000.0
    now[0] = 1059.0
    b.note_healthy()
    assert b.failures == 5  # not yet: a child that flaps keeps its backoff
    now[0] = 1060.0
    b.note_healthy()
    assert b.failures == 0 and restart_delay(b.failures + 1) == 2


async def test_a_busy_port_fails_the_start_naming_it_and_nothing_is_spawned(root: Path) -> None:  # noqa: F811
    with socket.socket() as other:  # another server holds the engine's port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        assert not port_is_free("127.0.0.1", port)
        b = StandInBackend(root, port)
        with pytest.raises(RuntimeError, match=f"port {port} on 127.0.0.1 is in use"):
            await b.start()
        assert b.spawned == 0 and b.proc is None


async def test_a_hung_child_is_killed_and_restarted(root: Path) -> None:  # noqa: F811
    b = StandInBackend(root, free_port(), probe_interval_s=0.2, probe_timeout_s=0.5, hung_after_probes=2)
    await b.start()
    try:
        first = b.proc
        assert first is not None
        os.kill(first.pid, signal.SIGSTOP)  # alive to the OS, silent to every request
        for _ in range(300):
            if b.restarts == 1 and b.proc is not first and b.healthy_since is not None:
                break
            await asyncio.sleep(0.1)
        assert b.restarts == 1 and b.spawned == 2 and b.failures == 1
        assert first.poll() == -signal.SIGKILL  # the hung one was killed, not left behind
        assert b.proc is not None and b.proc.poll() is None
    finally:
        await b.stop()
