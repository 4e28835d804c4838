"""The request log's batched writer loses nothing on shutdown, whenever the shutdown comes.

A real SQLite store; the writer is closed at each point of its cycle: while it gathers a batch (rows
already taken off the queue), while a write is in flight, and with rows still queued.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from cachegw.gateway.storage.recorder import Recorder, SqlRequestLog
from cachegw.gateway.storage.request_record import RequestRecord
from cachegw.gateway.storage.store import Store
from cachegw.gateway.storage.tables import RequestRow


def row(i: int) -> dict:
    return {
        "id": f"req-{i}",
        "ts": time.time(),
        "tenant": "t",
        "model": "m",
        "endpoint": "chat",
        "stream": False,
        "cache_result": "miss",
        "total_ms": 1.0,
        "status": 200,
    }


def count(store: Store) -> int:
    with store.session() as s:
        return int(s.scalar(select(func.count(RequestRow.id))) or 0)


@pytest.mark.parametrize(
    "close_after_s", [0.0, 0.05, 0.21, 0.5], ids=["queued", "gathering", "writing", "idle"]
)
def test_close_writes_every_recorded_row(tmp_path: Path, close_after_s: float) -> None:
    store = Store(f"sqlite:///{tmp_path / 'log.db'}")

    async def run() -> None:
        rec = Recorder(SqlRequestLog(store.session), flush_every_s=0.2)
        rec.start()
        for i in range(50):
            await rec.record(RequestRecord.from_dict(row(i)))
        await asyncio.sleep(0.01)  # the writer takes the first row and starts gathering its batch
        for i in range(50, 60):
            await rec.record(RequestRecord.from_dict(row(i)))
        await asyncio.sleep(close_after_s)
        await rec.close()

    asyncio.run(run())
    assert count(store) == 60
    store.close()


def test_rows_recorded_while_a_batch_is_written_go_in_the_next(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'log.db'}")

    async def run() -> int:
        rec = Recorder(SqlRequestLog(store.session), flush_every_s=0.05, max_batch=7)
        rec.start()
        for i in range(100):
            await rec.record(RequestRecord.from_dict(row(i)))
            if i % 10 == 0:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)
        written = count(store)  # max_batch 7 every 0.05 s: not all of it yet
        await rec.close()
        return written

    written_before_close = asyncio.run(run())
    assert 0 < written_before_close <= 100 and count(store) == 100
    store.close()
