"""Every database schema cachegw shipped before Alembic, transcribed from git history
(``git log -p -- gateway/storage/store.py gateway/storage/tables.py``), for the migration tests.

Written out here rather than taken from the migrations, so the tests check the migrations against the
history and not against themselves. Each shape is a list of changes applied in order to the first one.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import Boolean, Column, Float, Index, Integer, LargeBinary, MetaData, String, Table, Text


def _first(md: MetaData, autoincrement: bool) -> None:
    """519ea1e (2026-11-22 03:36): the caching gateway's first tables."""
    kw = {"sqlite_autoincrement": True} if autoincrement else {}
    entries = Table(
        "cache_entries",
        md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("tenant", String(64), nullable=False, index=True),
        Column("model", String(256), nullable=False, index=True),
        Column("endpoint", String(32), nullable=False),
        Column("scope", String(64), nullable=False, index=True),
        Column("exact_key", String(64), nullable=False, index=True),
        Column("query_text", Text, nullable=False),
        Column("embedding", LargeBinary),
        Column("response", Text, nullable=False),
        Column("finish_reason", String(32), nullable=False),
        Column("max_tokens", Integer),
        Column("prompt_tokens", Integer, nullable=False),
        Column("completion_tokens", Integer, nullable=False),
        Column("size_bytes", Integer, nullable=False),
        Column("created_at", Float, nullable=False),
        Column("last_hit_at", Float),
        Column("hit_count", Integer, nullable=False),
        Column("expires_at", Float, nullable=False, index=True),
        Column("bad", Boolean, nullable=False),
        **kw,
    )
    Index("ix_entries_lookup", entries.c.tenant, entries.c.model, entries.c.exact_key)
    Table(
        "requests",
        md,
        Column("id", String(64), primary_key=True),
        Column("ts", Float, nullable=False, index=True),
        Column("tenant", String(64), nullable=False, index=True),
        Column("model", String(256), nullable=False),
        Column("endpoint", String(32), nullable=False),
        Column("stream", Boolean, nullable=False),
        Column("cache_result", String(16), nullable=False, index=True),
        Column("similarity", Float),
        Column("threshold", Float),
        Column("entry_id", Integer),
        Column("rules_fired", String(256), nullable=False),
        Column("embed_ms", Float),
        Column("lookup_ms", Float),
        Column("backend_ms", Float),
        Column("total_ms", Float, nullable=False),
        Column("prompt_tokens", Integer),
        Column("completion_tokens", Integer),
        Column("cached_tokens", Integer),
        Column("status", Integer, nullable=False),
        Column("error", Text),
    )
    Table(
        "replies",
        md,
        Column("key", String(64), primary_key=True),
        Column("text", Text, nullable=False),
        Column("created_at", Float, nullable=False),
    )


def _admin(md: MetaData) -> None:
    """02ca5ac (11-22 05:16): admin API, settings, audit, feedback, per-entry thresholds."""
    md.tables["cache_entries"].append_column(Column("threshold", Float))
    requests = md.tables["requests"]
    for col in (
        Column("response_id", String(128), index=True),
        Column("stored_entry_id", Integer),
        Column("scope", String(64)),
        Column("system_hash", String(16)),
        Column("query_hash", String(16)),
        Column("query", Text),
    ):
        requests.append_column(col)
    Table(
        "settings",
        md,
        Column("key", String(64), primary_key=True),
        Column("value", Text, nullable=False),
        Column("version", Integer, nullable=False),
        Column("updated_at", Float, nullable=False),
    )
    Table(
        "audit",
        md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("ts", Float, nullable=False, index=True),
        Column("actor", String(128), nullable=False),
        Column("action", String(64), nullable=False),
        Column("target", String(256), nullable=False),
        Column("old", Text),
        Column("new", Text),
    )
    Table(
        "feedback",
        md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("ts", Float, nullable=False, index=True),
        Column("request_id", String(64), index=True),
        Column("entry_id", Integer, nullable=False, index=True),
        Column("tenant", String(64), nullable=False),
        Column("actor", String(128), nullable=False),
        Column("verdict", String(16), nullable=False),
        Column("cache_result", String(16)),
        Column("similarity", Float),
        Column("query", Text),
        Column("entry_query", Text),
        Column("action", String(256), nullable=False),
    )


def _backend(md: MetaData) -> None:
    """a5e8310 (11-22 11:09): several backends per model."""
    md.tables["requests"].append_column(Column("backend", String(512)))


def _replicas(md: MetaData) -> None:
    """fe8731f (11-22 12:48): replicas on one database (the table became AUTOINCREMENT at once)."""
    entries = md.tables["cache_entries"]
    entries.append_column(Column("updated_at", Float))
    Index("ix_cache_entries_updated_at", entries.c.updated_at)
    Index("ix_cache_entries_created_at", entries.c.created_at)
    Table(
        "entry_deletions",
        md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("entry_id", Integer, nullable=False),
        Column("size_bytes", Integer, nullable=False),
        Column("ts", Float, nullable=False, index=True),
    )


def _replies_by_age(md: MetaData) -> None:
    """4764d93 (11-22 14:26)."""
    Index("ix_replies_created_at", md.tables["replies"].c.created_at)


def _reason(md: MetaData) -> None:
    """17ed274 (11-24 04:41): x-cache-reason."""
    md.tables["requests"].append_column(Column("reason", String(32)))


def _volatile(md: MetaData) -> None:
    """9bf66b9 (11-24 09:12, branch volatile): learned volatile spans."""
    md.tables["requests"].append_column(Column("volatile", String(512)))


def _live_key(md: MetaData) -> None:
    """b7a5dec (11-24 09:20, branch live-key): one live entry per exact key."""
    t = md.tables["cache_entries"]
    Index(
        "ux_entries_live_key",
        t.c.tenant,
        t.c.model,
        t.c.exact_key,
        unique=True,
        sqlite_where=t.c.bad.is_(False),
        postgresql_where=t.c.bad.is_(False),
    )


Step = Callable[[MetaData], None]
# name -> (AUTOINCREMENT from the start, the changes after the first schema)
SHAPES: dict[str, tuple[bool, list[Step]]] = {
    "first": (False, []),
    "admin-api": (False, [_admin]),
    "backends": (False, [_admin, _backend]),
    "replicas": (True, [_admin, _backend, _replicas]),
    "replies-by-age": (True, [_admin, _backend, _replicas, _replies_by_age]),
    "reason": (True, [_admin, _backend, _replicas, _replies_by_age, _reason]),
    "volatile-branch": (True, [_admin, _backend, _replicas, _replies_by_age, _reason, _volatile]),
    "live-key-branch": (True, [_admin, _backend, _replicas, _replies_by_age, _reason, _live_key]),
    "merged": (True, [_admin, _backend, _replicas, _replies_by_age, _reason, _volatile, _live_key]),
    # made by the first cachegw, then started by every later one: columns added at start, ids not
    # AUTOINCREMENT (only a new table got that)
    "first-upgraded-in-place": (
        False,
        [_admin, _backend, _replicas, _replies_by_age, _reason, _volatile, _live_key],
    ),
}


def shape(name: str) -> MetaData:
    autoincrement, steps = SHAPES[name]
    md = MetaData()
    _first(md, autoincrement)
    for step in steps:
        step(md)
    return md
