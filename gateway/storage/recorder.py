"""Writes the request log: in small batches off the request path, or one commit per request.

``[gateway] request_log_commit``: "batched" (the default) commits every 0.2 s, so a kill -9 loses up
to the last 0.2 s of rows; "per_request" commits each row before the response is sent, for audit
needs: a client that has its answer has its row.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from cachetools import FIFOCache
from sqlalchemy.orm import Session, sessionmaker

from cachegw.gateway.storage.interfaces import RequestLogSink
from cachegw.gateway.storage.prune import delete_older
from cachegw.gateway.storage.request_record import RequestRecord
from cachegw.gateway.storage.tables import RequestRow

log = logging.getLogger("cachegw.gateway")


RECENT = 10_000  # rows kept in memory, so feedback right after a response finds its request


class SqlRequestLog:
    """``RequestLogSink`` in the ``requests`` table."""

    def __init__(self, session: sessionmaker[Session]) -> None:
        self.session = session

    def log_requests(self, records: list[RequestRecord]) -> None:
        if records:
            with self.session.begin() as s:
                s.add_all(record.to_row() for record in records)

    def prune(self, before: float) -> int:
        """Drop the rows of requests made before ``before`` (``[gateway] request_log_days``)."""
        return delete_older(self.session, RequestRow.ts, RequestRow.id, before)


class Recorder:
    def __init__(
        self,
        sink: RequestLogSink,
        flush_every_s: float = 0.2,
        max_batch: int = 256,
        per_request: bool = False,
    ) -> None:
        self.sink = sink
        self.per_request = per_request
        self.flush_every_s = flush_every_s
        self.max_batch = max_batch
        self.queue: asyncio.Queue[RequestRecord] = asyncio.Queue()
        self.task: asyncio.Task | None = None
        # by request id and by response id, the oldest written out first
        self._recent: FIFOCache[str, RequestRecord] = FIFOCache(2 * RECENT)
        self._batch: list[RequestRecord] = []  # taken off the queue, not written yet
        self._writing: asyncio.Future[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="cachegw-recorder")

    async def record(self, record: RequestRecord) -> None:
        """Queue the record, or with ``per_request`` commit it before returning (off the event loop)."""
        self._remember(record)
        if self.per_request:
            await self._write([record])
        else:
            self.queue.put_nowait(record)

    def _remember(self, record: RequestRecord) -> None:
        for key in (record.id, record.response_id):
            if key is not None:
                self._recent[key] = record

    def recent(self, request_id: str) -> RequestRecord | None:
        """A row recorded by this process lately, by request id or response id (maybe not yet written)."""
        return self._recent.get(request_id)

    async def _run(self) -> None:
        while True:
            self._batch = [await self.queue.get()]
            await asyncio.sleep(self.flush_every_s)
            while not self.queue.empty() and len(self._batch) < self.max_batch:
                self._batch.append(self.queue.get_nowait())
            rows, self._batch = self._batch, []
            # shielded: a close() arriving now waits for this write instead of dropping its rows
            self._writing = asyncio.ensure_future(self._write(rows))
            await asyncio.shield(self._writing)

    async def _write(self, rows: list[RequestRecord]) -> None:
        try:
            await asyncio.to_thread(self.sink.log_requests, rows)
        except Exception:  # the log must never take a request down with it
            log.exception("could not write %d request records", len(rows))

    async def close(self) -> None:
        """Write everything recorded so far (the batch being gathered included), then stop."""
        if self.task:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self._writing is not None:
            await self._writing
        rows, self._batch = self._batch, []
        while not self.queue.empty():
            rows.append(self.queue.get_nowait())
        if rows:
            await self._write(rows)
