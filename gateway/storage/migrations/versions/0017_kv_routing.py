"""KV-aware routing: the request log keeps why a backend was picked and the prefix it was expected to hold.

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

import sqlalchemy as sa

from cachegw.gateway.storage.migrations import guarded

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def applied(insp: sa.Inspector) -> bool:
    return guarded.has_column(insp, "requests", "expected_cached_tokens")


def upgrade() -> None:
    guarded.add_column("requests", sa.Column("route", sa.String(16), nullable=True))
    guarded.add_column("requests", sa.Column("expected_cached_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
