"""Several backends per model: the request log names the backend that answered a miss.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa

from cachegw.gateway.storage.migrations import guarded

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def applied(insp: sa.Inspector) -> bool:
    return guarded.has_column(insp, "requests", "backend")


def upgrade() -> None:
    guarded.add_column("requests", sa.Column("backend", sa.String(512), nullable=True))


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
