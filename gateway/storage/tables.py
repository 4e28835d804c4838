"""The SQL tables: cache entries, the change log replicas read, the request log, replies, settings,
the audit log, feedback, the false-hit evidence and the learned volatile templates (SQLAlchemy 2
declarative models; ``store.py`` reads and writes most of them, ``evidence_store.py`` the evidence,
``volatile_store.py`` the templates).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Float, Index, Integer, LargeBinary, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# The largest SQL integer (SQLite INTEGER, PostgreSQL BIGINT): ids and offsets above it are 400s.
MAX_ID = 2**63 - 1
# Entry ids and the keys of growing tables: BIGINT (PostgreSQL), and INTEGER on SQLite, where it is
# 64-bit already and only INTEGER PRIMARY KEY is the rowid that autoincrement needs.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


class CacheEntry(Base):
    """One stored answer: what was asked, in which scope, and the full non-stream response."""

    __tablename__ = "cache_entries"
    # ids are never reused (SQLite reuses the highest deleted one otherwise): replicas, the index
    # snapshots and the deletion log all name entries by id
    __table_args__ = {"sqlite_autoincrement": True}
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    model: Mapped[str] = mapped_column(String(256), index=True)
    endpoint: Mapped[str] = mapped_column(String(32))
    scope: Mapped[str] = mapped_column(String(64), index=True)
    exact_key: Mapped[str] = mapped_column(String(64), index=True)
    query_text: Mapped[str] = mapped_column(Text)
    embedding: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    response: Mapped[str] = mapped_column(Text)  # JSON of the completed, non-stream response
    finish_reason: Mapped[str] = mapped_column(String(32))
    max_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    size_bytes: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float, index=True)
    # Set when the entry is flagged bad or gets a learned threshold, so other replicas re-read it.
    updated_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    last_hit_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    hit_count: Mapped[int] = mapped_column(Integer, default=0)
    expires_at: Mapped[float] = mapped_column(Float, index=True)
    bad: Mapped[bool] = mapped_column(Boolean, default=False)
    # Learned from bad-hit feedback: a semantic hit on this entry needs at least this similarity.
    threshold: Mapped[float | None] = mapped_column(Float, nullable=True)


class ChangeRow(Base):
    """One change to the cache entries or the live settings, written in the same transaction as the
    change, so other replicas apply it (``gateway/storage/changes.py``). Ids never repeat; on
    PostgreSQL ``xact`` is the writing transaction's id, which tells a reader which rows may still
    commit below the ids it has read."""

    __tablename__ = "change_log"
    __table_args__ = {"sqlite_autoincrement": True}
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16))  # a gateway.storage.changes.ChangeKind value
    entry_id: Mapped[int | None] = mapped_column(BigId, nullable=True)
    size_bytes: Mapped[int] = mapped_column(Integer, default=0)  # of a deleted entry: replicas' totals
    xact: Mapped[int | None] = mapped_column(BigInteger, nullable=True, index=True)  # PostgreSQL only


class ChangeLogPruned(Base):
    """One row: the log position below which rows may have been pruned (a reader that has not read
    that far reloads everything instead)."""

    __tablename__ = "change_log_pruned"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    below: Mapped[int] = mapped_column(BigInteger)


class RequestRow(Base):
    """One request through the gateway: how the cache answered and what it cost (the request log;
    the gateway fills a ``gateway.storage.request_record.RequestRecord`` and maps it here)."""

    __tablename__ = "requests"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    model: Mapped[str] = mapped_column(String(256))
    endpoint: Mapped[str] = mapped_column(String(32))
    stream: Mapped[bool] = mapped_column(Boolean)
    cache_result: Mapped[str] = mapped_column(
        String(16), index=True
    )  # a gateway.cache.lookup.CacheResult value
    similarity: Mapped[float | None] = mapped_column(Float, nullable=True)  # nearest neighbour, hit or not
    threshold: Mapped[float | None] = mapped_column(Float, nullable=True)
    entry_id: Mapped[int | None] = mapped_column(BigId, nullable=True)
    rules_fired: Mapped[str] = mapped_column(String(256), default="")
    reason: Mapped[str | None] = mapped_column(String(32), nullable=True)  # x-cache-reason
    # volatile values moved out of the system prompt: "pattern:N" or "learned:<template>[label]"
    volatile: Mapped[str | None] = mapped_column(String(512), nullable=True)
    embed_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    lookup_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    backend_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    backend: Mapped[str | None] = mapped_column(String(512), nullable=True)  # the one that answered a miss
    total_ms: Mapped[float] = mapped_column(Float)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completion_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cached_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    status: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    response_id: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)  # body "id"
    stored_entry_id: Mapped[int | None] = mapped_column(BigId, nullable=True)  # a miss stored as entry
    scope: Mapped[str | None] = mapped_column(String(64), nullable=True)
    system_hash: Mapped[str | None] = mapped_column(String(16), nullable=True)
    query_hash: Mapped[str | None] = mapped_column(String(16), nullable=True)
    query: Mapped[str | None] = mapped_column(Text, nullable=True)  # first 500 chars, if configured
    # the API the client called (chat, completions, responses, messages, embeddings); `endpoint` is the
    # cache's shape (chat or completions) the request was served through
    api: Mapped[str | None] = mapped_column(String(16), nullable=True)
    # routing = "kv": why the backend was picked (prefix, load, hash) and the prompt tokens its KV events
    # said it held, beside cached_tokens (what it then reported)
    route: Mapped[str | None] = mapped_column(String(16), nullable=True)
    expected_cached_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Reply(Base):
    """Exact text of an assistant reply the gateway produced, keyed by its normalised form, so a
    client that sends it back re-formatted can be given the original bytes (prefix-cache hits)."""

    __tablename__ = "replies"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    text: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float, index=True)  # pruned by age


class Setting(Base):
    """Settings changed at run time through the admin API; they override config.toml."""

    __tablename__ = "settings"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)  # JSON
    version: Mapped[int] = mapped_column(Integer, default=1)
    updated_at: Mapped[float] = mapped_column(Float)


class AuditEvent(Base):
    """Who changed what through the admin API, and when."""

    __tablename__ = "audit"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(256), default="")
    old: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON
    new: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON


class Feedback(Base):
    """A hit reported bad, by a tenant or an admin."""

    __tablename__ = "feedback"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    request_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    entry_id: Mapped[int] = mapped_column(BigId, index=True)
    tenant: Mapped[str] = mapped_column(String(64))
    actor: Mapped[str] = mapped_column(String(128))
    verdict: Mapped[str] = mapped_column(String(16))
    cache_result: Mapped[str | None] = mapped_column(String(16), nullable=True)
    similarity: Mapped[float | None] = mapped_column(Float, nullable=True)
    query: Mapped[str | None] = mapped_column(Text, nullable=True)  # the query that got the bad answer
    entry_query: Mapped[str | None] = mapped_column(Text, nullable=True)
    action: Mapped[str] = mapped_column(String(256), default="")  # what the cache did about it


class HitAudit(Base):
    """One piece of false-hit evidence (``gateway/cache/error_control.py``): a pair scored by the semantic
    tier and whether the stored answer was right for the new query. Self-contained (no foreign keys):
    every replica reads the rows newer than its last look on the sync cycle."""

    __tablename__ = "hit_audits"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    model: Mapped[str] = mapped_column(String(256))
    tenant: Mapped[str] = mapped_column(String(64))  # the tenant's name (or key hash), as thresholds
    score: Mapped[float] = mapped_column(Float)  # verifier probability, or cosine with the verifier off
    right: Mapped[bool] = mapped_column(Boolean)
    source: Mapped[str] = mapped_column(String(16))  # hit | near-miss | feedback | seed
    entry_id: Mapped[int | None] = mapped_column(BigId, nullable=True)
    request_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    backend_tokens: Mapped[int] = mapped_column(Integer, default=0)  # what the audit's re-ask cost
    # a right near miss: the near-miss request's own stored entry, linked to ``entry_id`` (same answer)
    linked_entry_id: Mapped[int | None] = mapped_column(BigId, nullable=True)


Index("ix_entries_lookup", CacheEntry.tenant, CacheEntry.model, CacheEntry.exact_key)
LIVE_KEY_INDEX = "ux_entries_live_key"
# Partial indexes exist on SQLite and PostgreSQL only: elsewhere the transactional replace alone holds.
Index(
    LIVE_KEY_INDEX,
    CacheEntry.tenant,
    CacheEntry.model,
    CacheEntry.exact_key,
    unique=True,
    sqlite_where=CacheEntry.bad.is_(False),
    postgresql_where=CacheEntry.bad.is_(False),
).ddl_if(dialect=("sqlite", "postgresql"))


class StoredResponse(Base):
    """A Response the gateway returned (the Responses API with ``store``), so a later request can go on
    from it (``previous_response_id``) and clients can read or delete it; one tenant's only."""

    __tablename__ = "responses"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[float] = mapped_column(Float, index=True)  # pruned by age
    response: Mapped[str] = mapped_column(Text)  # the Response object, JSON
    items: Mapped[str] = mapped_column(Text)  # the whole conversation's input items before it, JSON


class RateWindow(Base):
    """What one tenant spent in one minute (``window``: minutes since the epoch), counted by every replica
    in one row: the per-tenant rate limits (``[tenants] rate_limits``) read it back."""

    __tablename__ = "rate_windows"
    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    window: Mapped[int] = mapped_column(Integer, primary_key=True)
    requests: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(Integer, default=0)


class VolatileTemplate(Base):
    """A system-prompt template with volatile spans one replica learned from a tenant's traffic
    (``gateway/request/volatile_learner.py``), so every replica, and one started later, applies it.
    One row per tenant and template: its id is the digest of its constant parts."""

    __tablename__ = "volatile_templates"
    __table_args__ = (
        UniqueConstraint("tenant", "template_id", name="ux_volatile_templates_key"),
        {
            "sqlite_autoincrement": True
        },  # ids are never reused: replicas read the rows after the last they saw
    )
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(64))  # the tenant's id, as the learner names it
    template_id: Mapped[str] = mapped_column(String(64))
    template: Mapped[str] = mapped_column(Text)  # JSON: its constant parts and span labels
    learned_at: Mapped[float] = mapped_column(Float)
    matches: Mapped[int] = mapped_column(Integer, default=0)  # over all replicas, flushed in batches
    last_match_at: Mapped[float | None] = mapped_column(Float, nullable=True)
