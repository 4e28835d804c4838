"""Learned volatile templates, shared by the replicas: a template one learns, every one applies.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

import sqlalchemy as sa

from cachegw.gateway.storage.migrations import guarded

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None
# as the models' BigId: BIGINT, and INTEGER (64-bit, the rowid) on SQLite
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    guarded.create_table(
        "volatile_templates",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("template_id", sa.String(length=64), nullable=False),
        sa.Column("template", sa.Text(), nullable=False),
        sa.Column("learned_at", sa.Float(), nullable=False),
        sa.Column("matches", sa.Integer(), nullable=False),
        sa.Column("last_match_at", sa.Float(), nullable=True),
        sa.UniqueConstraint("tenant", "template_id", name="ux_volatile_templates_key"),
        sqlite_autoincrement=True,
    )


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
