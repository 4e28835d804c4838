"""SQL of the per-tenant rate windows: one row per tenant and minute, incremented by every replica in one
statement (an upsert), so the count is the same whoever asks; old windows are pruned."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, sessionmaker

from cachegw.gateway.storage.tables import RateWindow


class RateStore:
    def __init__(self, session: sessionmaker[Session]) -> None:
        self.session = session

    def add(self, tenant: str, window: int, requests: int, tokens: int) -> tuple[int, int]:
        """Add to the tenant's window; (requests, tokens) in it afterwards, all replicas counted."""
        with self.session.begin() as s:
            dialect = s.get_bind().dialect.name
            if dialect in ("sqlite", "postgresql"):
                insert = sqlite_insert if dialect == "sqlite" else pg_insert
                stmt = insert(RateWindow).values(
                    tenant=tenant, window=window, requests=requests, tokens=tokens
                )
                stmt = stmt.on_conflict_do_update(
                    index_elements=["tenant", "window"],
                    set_={
                        "requests": RateWindow.requests + stmt.excluded.requests,
                        "tokens": RateWindow.tokens + stmt.excluded.tokens,
                    },
                )
                s.execute(stmt)
            else:  # another database: read, then write, in one transaction
                row = s.get(RateWindow, (tenant, window), with_for_update=True)
                if row is None:
                    s.add(RateWindow(tenant=tenant, window=window, requests=requests, tokens=tokens))
                else:
                    row.requests += requests
                    row.tokens += tokens
            s.flush()
            got = s.execute(
                select(RateWindow.requests, RateWindow.tokens).where(
                    RateWindow.tenant == tenant, RateWindow.window == window
                )
            ).one()
            return int(got[0]), int(got[1])

    def prune(self, before_window: int) -> None:
        with self.session.begin() as s:
            s.execute(delete(RateWindow).where(RateWindow.window < before_window))
