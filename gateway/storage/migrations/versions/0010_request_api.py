"""The request log keeps which API the client called (chat, completions, responses, messages, embeddings).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa

from cachegw.gateway.storage.migrations import guarded

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def applied(insp: sa.Inspector) -> bool:
    return guarded.has_column(insp, "requests", "api")


def upgrade() -> None:
    guarded.add_column("requests", sa.Column("api", sa.String(16), nullable=True))


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
