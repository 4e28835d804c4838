"""Replicas on one database: entries say when they changed, deletions are logged for the other
replicas, and entry ids are never reused (AUTOINCREMENT on SQLite, where the table is rebuilt for it).

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cachegw.gateway.storage.migrations import guarded

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

LIVE_KEY_INDEX = "ux_entries_live_key"  # revision 0008's; an older cachegw may have made it already


def _ids_reused(insp: sa.Inspector) -> bool:
    """A SQLite table without AUTOINCREMENT hands the highest deleted id out again."""
    if insp.bind.dialect.name != "sqlite" or not insp.has_table("cache_entries"):
        return False
    conn = insp.bind
    assert isinstance(conn, sa.Connection)  # gateway/storage/migrate.py inspects a connection
    sql = conn.exec_driver_sql(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'cache_entries'"
    ).scalar()
    return "AUTOINCREMENT" not in str(sql).upper()


def applied(insp: sa.Inspector) -> bool:
    return (
        insp.has_table("entry_deletions")
        and guarded.has_column(insp, "cache_entries", "updated_at")
        and not _ids_reused(insp)
    )


def upgrade() -> None:
    if _ids_reused(guarded.inspector()):
        if guarded.has_index(guarded.inspector(), "cache_entries", LIVE_KEY_INDEX):
            op.drop_index(LIVE_KEY_INDEX, "cache_entries")  # partial: 0008 makes it again
        # the copy keeps every row and id; SQLite continues after the highest id in the table
        with op.batch_alter_table(
            "cache_entries", recreate="always", table_kwargs={"sqlite_autoincrement": True}
        ):
            pass
        if guarded.has_table(guarded.inspector(), "entry_deletions"):  # and not after a logged deletion
            op.execute(
                "UPDATE sqlite_sequence SET seq = max(seq, "
                "(SELECT coalesce(max(entry_id), 0) FROM entry_deletions)) WHERE name = 'cache_entries'"
            )
    guarded.add_column("cache_entries", sa.Column("updated_at", sa.Float, nullable=True))
    guarded.create_index("ix_cache_entries_updated_at", "cache_entries", ["updated_at"])
    guarded.create_index("ix_cache_entries_created_at", "cache_entries", ["created_at"])
    guarded.create_table(
        "entry_deletions",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("entry_id", sa.Integer, nullable=False),
        sa.Column("size_bytes", sa.Integer, nullable=False),
        sa.Column("ts", sa.Float, nullable=False),
    )
    guarded.create_index("ix_entry_deletions_ts", "entry_deletions", ["ts"])


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
