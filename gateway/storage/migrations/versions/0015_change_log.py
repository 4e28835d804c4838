"""The change log replicas follow: one row per stored, updated or deleted entry and per change of the
live settings, written in the change's own transaction, read by position instead of by the writers'
clocks. The deletion log it replaces is dropped (a replica that starts reads the entries whole).

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cachegw.gateway.storage.migrations import guarded
from cachegw.gateway.storage.tables import BigId

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    guarded.create_table(
        "change_log",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("entry_id", BigId, nullable=True),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
        sa.Column("xact", sa.BigInteger(), nullable=True),
        sqlite_autoincrement=True,
    )
    guarded.create_index("ix_change_log_xact", "change_log", ["xact"])
    guarded.create_table(
        "change_log_pruned",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("below", sa.BigInteger(), nullable=False),
    )
    if guarded.has_table(guarded.inspector(), "entry_deletions"):
        op.drop_table("entry_deletions")  # its index goes with it


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
