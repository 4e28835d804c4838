"""Near misses that become hits: a right near-miss audit names the near-miss request's own stored entry,
linked to the candidate whose answer it matched (gateway/cache/links.py).

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

import sqlalchemy as sa

from cachegw.gateway.storage.migrations import guarded
from cachegw.gateway.storage.tables import BigId

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def applied(insp: sa.Inspector) -> bool:
    return guarded.has_column(insp, "hit_audits", "linked_entry_id")


def upgrade() -> None:
    guarded.add_column("hit_audits", sa.Column("linked_entry_id", BigId, nullable=True))


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
