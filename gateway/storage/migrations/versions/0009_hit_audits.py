"""False-hit evidence: audited (score, verdict) pairs per scope, which set each scope's line.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa

from cachegw.gateway.storage.migrations import guarded

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    guarded.create_table(
        "hit_audits",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True, nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("score", sa.Float(), nullable=False),
        sa.Column("right", sa.Boolean(), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("entry_id", sa.Integer(), nullable=True),
        sa.Column("request_id", sa.String(length=64), nullable=True),
        sa.Column("backend_tokens", sa.Integer(), nullable=False),
    )
    guarded.create_index("ix_hit_audits_ts", "hit_audits", ["ts"])


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
