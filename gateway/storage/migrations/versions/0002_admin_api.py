"""The admin API: run-time settings, the audit log, feedback, per-entry thresholds and more of each
request in its log row.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa

from cachegw.gateway.storage.migrations import guarded

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def applied(insp: sa.Inspector) -> bool:
    return insp.has_table("audit") and guarded.has_column(insp, "cache_entries", "threshold")


def upgrade() -> None:
    guarded.add_column("cache_entries", sa.Column("threshold", sa.Float, nullable=True))
    for column in (
        sa.Column("response_id", sa.String(128), nullable=True),
        sa.Column("stored_entry_id", sa.Integer, nullable=True),
        sa.Column("scope", sa.String(64), nullable=True),
        sa.Column("system_hash", sa.String(16), nullable=True),
        sa.Column("query_hash", sa.String(16), nullable=True),
        sa.Column("query", sa.Text, nullable=True),
    ):
        guarded.add_column("requests", column)
    guarded.create_index("ix_requests_response_id", "requests", ["response_id"])
    guarded.create_table(
        "settings",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    guarded.create_table(
        "audit",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", sa.String(256), nullable=False),
        sa.Column("old", sa.Text, nullable=True),
        sa.Column("new", sa.Text, nullable=True),
    )
    guarded.create_index("ix_audit_ts", "audit", ["ts"])
    guarded.create_table(
        "feedback",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("request_id", sa.String(64), nullable=True),
        sa.Column("entry_id", sa.Integer, nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("verdict", sa.String(16), nullable=False),
        sa.Column("cache_result", sa.String(16), nullable=True),
        sa.Column("similarity", sa.Float, nullable=True),
        sa.Column("query", sa.Text, nullable=True),
        sa.Column("entry_query", sa.Text, nullable=True),
        sa.Column("action", sa.String(256), nullable=False),
    )
    for name in ("ts", "request_id", "entry_id"):
        guarded.create_index(f"ix_feedback_{name}", "feedback", [name])


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
