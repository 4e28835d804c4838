"""The request log keeps each answer's x-cache-reason.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa

from cachegw.gateway.storage.migrations import guarded

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def applied(insp: sa.Inspector) -> bool:
    return guarded.has_column(insp, "requests", "reason")


def upgrade() -> None:
    guarded.add_column("requests", sa.Column("reason", sa.String(32), nullable=True))


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
