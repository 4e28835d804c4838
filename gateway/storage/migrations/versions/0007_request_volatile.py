"""The request log keeps which volatile values of the system prompt moved, and by which rule.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa

from cachegw.gateway.storage.migrations import guarded

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def applied(insp: sa.Inspector) -> bool:
    return guarded.has_column(insp, "requests", "volatile")


def upgrade() -> None:
    guarded.add_column("requests", sa.Column("volatile", sa.String(512), nullable=True))


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
