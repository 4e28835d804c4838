"""Replies are pruned by age: an index on their creation time.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa

from cachegw.gateway.storage.migrations import guarded

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def applied(insp: sa.Inspector) -> bool:
    return guarded.has_index(insp, "replies", "ix_replies_created_at")


def upgrade() -> None:
    guarded.create_index("ix_replies_created_at", "replies", ["created_at"])


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
