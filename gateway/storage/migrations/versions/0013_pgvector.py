"""Nothing now: the pgvector table, index and trigger are installed by the first replica that starts
with ``[index] store = "pgvector"`` (``pgvector_schema.install`` via ``PgVectorIndex``), so a database
the FAISS store uses pays no trigger on its writes. Kept so the revision chain stays whole; a database
that ran an earlier form of this revision keeps what it installed.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """See the module docstring: the store installs its schema, not the migration."""


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
