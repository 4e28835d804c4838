"""64-bit ids: entry ids, and the keys of the tables that grow with traffic, become BIGINT, with their
sequences, so a busy database never runs out at 2^31 - 1.

PostgreSQL only: SQLite's INTEGER (and its INTEGER PRIMARY KEY rowid) is 64-bit already. On a large
PostgreSQL table ALTER ... TYPE rewrites it under an exclusive lock: plan the upgrade's start-up time.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

# (table, column, nullable, is its serial primary key)
COLUMNS = (
    ("cache_entries", "id", False, True),
    ("entry_deletions", "id", False, True),
    ("entry_deletions", "entry_id", False, False),
    ("requests", "entry_id", True, False),
    ("requests", "stored_entry_id", True, False),
    ("audit", "id", False, True),
    ("feedback", "id", False, True),
    ("feedback", "entry_id", False, False),
    ("hit_audits", "id", False, True),
    ("hit_audits", "entry_id", True, False),
)


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    insp = sa.inspect(bind)
    for table, column, nullable, serial in COLUMNS:
        if not insp.has_table(table):  # entry_deletions, in a database rewound from 0015 on
            continue
        op.alter_column(
            table, column, type_=sa.BigInteger(), existing_type=sa.Integer(), existing_nullable=nullable
        )
        if serial:  # a serial's sequence is AS integer (max 2^31 - 1) until told otherwise
            seq = bind.execute(sa.select(sa.func.pg_get_serial_sequence(table, column))).scalar()
            if seq is not None:
                op.execute(f"ALTER SEQUENCE {seq} AS bigint")


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
