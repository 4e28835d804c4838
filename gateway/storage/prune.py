"""Delete a growing table's rows older than a cutoff, in short transactions.

Retention runs beside live traffic: one ``DELETE`` of a month of request-log rows would hold its write
lock (all of SQLite's) for as long as it takes, so rows go in batches of ``BATCH``, each its own commit.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import InstrumentedAttribute, Session, sessionmaker

BATCH = 5000


def delete_older(
    session: sessionmaker[Session],
    ts: InstrumentedAttribute[Any],
    key: InstrumentedAttribute[Any],
    cutoff: float,
) -> int:
    """Delete the rows of ``ts``'s table with ``ts < cutoff`` (``key`` is its primary key); how many went."""
    gone = 0
    while True:
        with session.begin() as s:
            keys = list(s.scalars(select(key).where(ts < cutoff).limit(BATCH)))
            if keys:
                s.execute(
                    delete(key.class_).where(key.in_(keys)).execution_options(synchronize_session=False)
                )
        gone += len(keys)
        if len(keys) < BATCH:
            return gone
