"""When a replica syncs: at once when the database says something changed, else on a slow poll.

``Follower.run`` waits for a wake-up (``wake``: the PostgreSQL listener calls it on each notification
and after each reconnect) or for ``[cache] sync_interval_s`` to pass, whichever comes first, then
syncs once. Wake-ups that arrive during a sync make one more sync, not one each: a burst of commits
costs a read or two.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("cachegw.gateway")


class Follower:
    def __init__(self, sync: Callable[[], Awaitable[object]], poll_s: float) -> None:
        self.sync, self.poll_s = sync, poll_s
        self._woken = asyncio.Event()

    def wake(self) -> None:
        self._woken.set()

    async def run(self) -> None:
        """Sync on each wake-up or poll until cancelled; a failed sync is logged and the next goes on."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), self.poll_s)
            self._woken.clear()
            try:
                await self.sync()
            except Exception:
                log.exception("replica sync failed")
