"""One live entry per exact key: the older copies of a key are deleted (logged for the replicas that
hold them; the newest stays) and a unique index over the live rows forbids new ones.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import logging
import time

import sqlalchemy as sa
from alembic import op

from cachegw.gateway.storage.migrations import guarded

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

LIVE_KEY_INDEX = "ux_entries_live_key"
log = logging.getLogger("cachegw.gateway")

entries = sa.table(
    "cache_entries",
    sa.column("id", sa.Integer),
    sa.column("tenant", sa.String),
    sa.column("model", sa.String),
    sa.column("exact_key", sa.String),
    sa.column("bad", sa.Boolean),
    sa.column("size_bytes", sa.Integer),
)
deletions = sa.table(
    "entry_deletions",
    sa.column("entry_id", sa.Integer),
    sa.column("size_bytes", sa.Integer),
    sa.column("ts", sa.Float),
)


def applied(insp: sa.Inspector) -> bool:
    return guarded.has_index(insp, "cache_entries", LIVE_KEY_INDEX)


def retire_duplicate_keys(conn: sa.Connection) -> int:
    """Delete every live entry a newer live entry of the same exact key supersedes, and log each
    deletion; the count deleted."""
    newer = entries.alias("newer")
    superseded = sa.exists().where(
        newer.c.tenant == entries.c.tenant,
        newer.c.model == entries.c.model,
        newer.c.exact_key == entries.c.exact_key,
        newer.c.bad.is_(False),
        newer.c.id > entries.c.id,
    )
    rows = conn.execute(
        sa.select(entries.c.id, entries.c.size_bytes).where(entries.c.bad.is_(False), superseded)
    ).all()
    if rows:
        conn.execute(sa.delete(entries).where(entries.c.id.in_([int(i) for i, _ in rows])))
        if sa.inspect(conn).has_table("entry_deletions"):  # gone from 0015 on (a rewound database)
            now = time.time()
            conn.execute(
                sa.insert(deletions), [{"entry_id": int(i), "size_bytes": int(s), "ts": now} for i, s in rows]
            )
        log.warning("retired %d older copies of cached answers (one live entry per exact key)", len(rows))
    return len(rows)


def upgrade() -> None:
    if guarded.has_index(guarded.inspector(), "cache_entries", LIVE_KEY_INDEX):
        return
    conn = op.get_bind()
    retire_duplicate_keys(conn)
    if conn.dialect.name in ("sqlite", "postgresql"):  # partial indexes exist on these two only
        live = entries.c.bad.is_(False)  # as gateway/storage/tables.py declares it
        op.create_index(
            LIVE_KEY_INDEX,
            "cache_entries",
            ["tenant", "model", "exact_key"],
            unique=True,
            sqlite_where=live,
            postgresql_where=live,
        )


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
