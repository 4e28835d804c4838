"""The pgvector index's table, its HNSW index and the trigger that fills it (``[index] store =
"pgvector"``), on PostgreSQL servers that have the ``vector`` extension; elsewhere nothing changes
(SQLite, or PostgreSQL without pgvector: the FAISS store needs none of it).

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import logging

from alembic import op
from sqlalchemy.exc import DBAPIError

from cachegw.gateway.storage import pgvector_schema

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

log = logging.getLogger("cachegw.gateway")


def upgrade() -> None:
    conn = op.get_bind()
    if not pgvector_schema.available(conn):
        return
    try:
        with conn.begin_nested():  # a role that may not create the extension keeps the FAISS store
            pgvector_schema.install(conn)
    except DBAPIError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        log.warning("pgvector is available but its schema could not be installed: %s", reason)


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
