"""The first schema (cachegw 0.1, before the admin API): cache entries, the request log, replies.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa

from cachegw.gateway.storage.migrations import guarded

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def applied(insp: sa.Inspector) -> bool:
    return all(insp.has_table(t) for t in ("cache_entries", "requests", "replies"))


def upgrade() -> None:
    guarded.create_table(
        "cache_entries",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("scope", sa.String(64), nullable=False),
        sa.Column("exact_key", sa.String(64), nullable=False),
        sa.Column("query_text", sa.Text, nullable=False),
        sa.Column("embedding", sa.LargeBinary, nullable=True),
        sa.Column("response", sa.Text, nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=False),
        sa.Column("max_tokens", sa.Integer, nullable=True),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("size_bytes", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("last_hit_at", sa.Float, nullable=True),
        sa.Column("hit_count", sa.Integer, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
        sa.Column("bad", sa.Boolean, nullable=False),
    )
    for column in ("tenant", "model", "scope", "exact_key", "expires_at"):
        guarded.create_index(f"ix_cache_entries_{column}", "cache_entries", [column])
    guarded.create_index("ix_entries_lookup", "cache_entries", ["tenant", "model", "exact_key"])
    guarded.create_table(
        "requests",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("stream", sa.Boolean, nullable=False),
        sa.Column("cache_result", sa.String(16), nullable=False),
        sa.Column("similarity", sa.Float, nullable=True),
        sa.Column("threshold", sa.Float, nullable=True),
        sa.Column("entry_id", sa.Integer, nullable=True),
        sa.Column("rules_fired", sa.String(256), nullable=False),
        sa.Column("embed_ms", sa.Float, nullable=True),
        sa.Column("lookup_ms", sa.Float, nullable=True),
        sa.Column("backend_ms", sa.Float, nullable=True),
        sa.Column("total_ms", sa.Float, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=True),
        sa.Column("completion_tokens", sa.Integer, nullable=True),
        sa.Column("cached_tokens", sa.Integer, nullable=True),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("error", sa.Text, nullable=True),
    )
    for column in ("ts", "tenant", "cache_result"):
        guarded.create_index(f"ix_requests_{column}", "requests", [column])
    guarded.create_table(
        "replies",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    raise NotImplementedError("cachegw upgrades only")
