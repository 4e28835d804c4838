"""Per-tenant rate limits: requests and tokens a minute, counted across replicas.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa

from cachegw.gateway.storage.migrations import guarded

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    guarded.create_table(
        "rate_windows",
        sa.Column("tenant", sa.String(length=64), primary_key=True, nullable=False),
        sa.Column("window", sa.Integer(), primary_key=True, nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
    )


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
