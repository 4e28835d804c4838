"""The Responses API's stored responses (``previous_response_id``, GET and DELETE of a response).

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa

from cachegw.gateway.storage.migrations import guarded

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    guarded.create_table(
        "responses",
        sa.Column("id", sa.String(length=64), primary_key=True, nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("response", sa.Text(), nullable=False),
        sa.Column("items", sa.Text(), nullable=False),
    )
    guarded.create_index("ix_responses_tenant", "responses", ["tenant"])
    guarded.create_index("ix_responses_created_at", "responses", ["created_at"])


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
