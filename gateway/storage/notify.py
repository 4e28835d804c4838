"""One listening connection per replica on PostgreSQL: each commit that wrote the change log wakes
the replica's sync at once (``NOTIFY`` from ``gateway/storage/changes.py``).

The connection is its own (psycopg 3, async, autocommit), outside the pool. When it drops, the
listener reconnects with a growing pause and wakes the sync once connected again: what was
committed while nobody listened is in the log, and the fallback poll covers the gap meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sqlalchemy.engine import make_url

from cachegw.gateway.storage.changes import CHANNEL

log = logging.getLogger("cachegw.gateway")

BACKOFF_S = (0.5, 30.0)  # first and longest pause between reconnects


def listens(database_url: str) -> bool:
    """Whether the database can notify (PostgreSQL); others rely on the fallback poll."""
    return database_url.startswith("postgresql")


class ChangeListener:
    def __init__(self, database_url: str, wake: Callable[[], None]) -> None:
        """``wake`` is called on every notification and after every (re)connect; it must be cheap
        (it sets an event: a burst of notifications becomes one sync)."""
        url = make_url(database_url).set(drivername="postgresql")
        self.dsn = url.render_as_string(hide_password=False)
        self.wake = wake
        self.connected = False

    async def run(self) -> None:
        """Listen until cancelled, reconnecting whenever the connection drops."""
        import psycopg

        pause = BACKOFF_S[0]
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self.connected, pause = True, BACKOFF_S[0]
                    self.wake()  # whatever committed while nobody listened
                    async for _ in conn.notifies():
                        self.wake()
            except (psycopg.Error, OSError) as exc:
                log.warning("change listener: %s; reconnecting in %.1f s", str(exc).strip(), pause)
            finally:
                self.connected = False
            await asyncio.sleep(pause)
            pause = min(pause * 2, BACKOFF_S[1])
