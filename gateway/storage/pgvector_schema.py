"""The pgvector side of the schema: a vector per cache entry, kept in step by the database itself.

``entry_vectors`` holds one ``vector(384)`` per entry that has an embedding, keyed by the entry's id
(deleting the entry deletes it: ON DELETE CASCADE) with the entry's scope beside it, so a search
filters by scope and orders by distance in one query over one HNSW index (inner product: the
embeddings are unit vectors, so it is their cosine). A trigger on ``cache_entries`` writes the vector
from the entry's float32 ``embedding`` bytes when the entry is inserted and deletes it when the entry
is flagged bad, in the same transaction: a committed answer is searchable by every replica at once,
whichever replica (or cachegw version) wrote it.

The scope is a hash of tenant, model and context (docs/replicas.md), so the scope filter is the tenant
filter too; with ``[tenants] shared_cache`` tenants share scopes on purpose, as in the FAISS store.

Installed by ``PgVectorIndex`` when a replica with ``[index] store = "pgvector"`` starts, never by a
migration: a database only the FAISS store uses has no trigger to pay on every write (about 2 ms per
stored entry, most of it the HNSW insert: docs/benchmarks.md). Every statement is idempotent and an
advisory lock makes replicas starting together install it once; entries stored before (by FAISS-store
replicas, or before the switch) are back-filled then, and from then on the trigger follows every write,
whichever store the writing replica runs.
"""

from __future__ import annotations

import logging

from sqlalchemy import Connection, text

log = logging.getLogger("cachegw.gateway")

DIM = 384  # the embedding width the column is declared with (all-MiniLM-L6-v2)
TABLE = "entry_vectors"
INSTALL_LOCK = 0x63616368_65677702  # pg_advisory_xact_lock key while installing (any fixed number)

# float32 little-endian bytes -> vector: sign, exponent and mantissa of each 4-byte word (exact in float8)
_DECODE = f"""
CREATE OR REPLACE FUNCTION cachegw_embedding_vector(b bytea) RETURNS vector
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $fn$
  SELECT CASE WHEN length(b) = {4 * DIM} THEN (
    SELECT array_agg(
      (CASE WHEN e = 0 THEN m * 2.0::float8 ^ -149
            ELSE (1 + m * 2.0::float8 ^ -23) * 2.0::float8 ^ (e - 127) END)
      * (1 - 2 * s) ORDER BY i)::real[]::vector
    FROM (SELECT i, (u >> 31) & 1 AS s, (u >> 23) & 255 AS e, u & 8388607 AS m
          FROM (SELECT i, get_byte(b, 4 * i)::bigint | (get_byte(b, 4 * i + 1)::bigint << 8)
                       | (get_byte(b, 4 * i + 2)::bigint << 16) | (get_byte(b, 4 * i + 3)::bigint << 24) AS u
                FROM generate_series(0, {DIM - 1}) AS i) AS words) AS parts)
  END
$fn$"""

_TABLE = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
  entry_id bigint PRIMARY KEY REFERENCES cache_entries (id) ON DELETE CASCADE,
  scope varchar(64) NOT NULL,
  embedding vector({DIM}) NOT NULL
)"""

_FOLLOW = f"""
CREATE OR REPLACE FUNCTION cachegw_entry_vector_follow() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF NEW.embedding IS NOT NULL AND NEW.scope <> '' AND NOT NEW.bad
       AND length(NEW.embedding) = {4 * DIM} THEN
      INSERT INTO {TABLE} (entry_id, scope, embedding)
      VALUES (NEW.id, NEW.scope, cachegw_embedding_vector(NEW.embedding))
      ON CONFLICT (entry_id) DO NOTHING;
    END IF;
  ELSIF NEW.bad AND NOT OLD.bad THEN
    DELETE FROM {TABLE} WHERE entry_id = NEW.id;
  END IF;
  RETURN NULL;
END
$fn$"""

_TRIGGER = """
CREATE TRIGGER cachegw_entry_vectors AFTER INSERT OR UPDATE OF bad ON cache_entries
FOR EACH ROW EXECUTE FUNCTION cachegw_entry_vector_follow()"""

_SCOPE_INDEX = f"CREATE INDEX IF NOT EXISTS ix_{TABLE}_scope ON {TABLE} (scope)"
# [index] hnsw_m and ef_construction, as the FAISS store's graphs; ef_search is set per search
_HNSW_INDEX = (
    f"CREATE INDEX IF NOT EXISTS ix_{TABLE}_hnsw ON {TABLE} USING hnsw (embedding vector_ip_ops) "
    "WITH (m = {m}, ef_construction = {ef_construction})"
)

# entries stored before the trigger existed (a database the FAISS store filled)
_BACKFILL = f"""
INSERT INTO {TABLE} (entry_id, scope, embedding)
SELECT c.id, c.scope, cachegw_embedding_vector(c.embedding) FROM cache_entries AS c
WHERE c.embedding IS NOT NULL AND c.scope <> '' AND NOT c.bad AND length(c.embedding) = {4 * DIM}
  AND NOT EXISTS (SELECT 1 FROM {TABLE} AS v WHERE v.entry_id = c.id)
ON CONFLICT (entry_id) DO NOTHING"""


def available(conn: Connection) -> bool:
    """Whether this server can run pgvector (the extension is installed on it, created or not)."""
    if conn.dialect.name != "postgresql":
        return False
    found = conn.execute(text("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")).first()
    return found is not None


def installed(conn: Connection) -> bool:
    """Whether this database has the table, its HNSW index and the trigger that fills it (an index
    dropped to change its m or ef_construction is built again by the next start)."""
    if conn.dialect.name != "postgresql":
        return False
    query = text(
        "SELECT to_regclass(:t) IS NOT NULL AND to_regclass(:ix) IS NOT NULL AND EXISTS "
        "(SELECT 1 FROM pg_trigger WHERE tgname = 'cachegw_entry_vectors')"
    )
    return bool(conn.execute(query, {"t": TABLE, "ix": f"ix_{TABLE}_hnsw"}).scalar())


def install(conn: Connection, m: int = 16, ef_construction: int = 64) -> int:
    """Create the extension (when missing), the table, its indexes (HNSW with ``m`` and
    ``ef_construction``) and the trigger, in the caller's transaction, and give every stored entry its
    vector; returns how many were back-filled. An index that exists keeps the shape it was built with."""
    if not (2 <= m <= 100 and 4 <= ef_construction <= 1000 and ef_construction >= 2 * m):
        raise ValueError(
            f"pgvector's HNSW needs 2 <= m <= 100 and 2m <= ef_construction <= 1000: {m}, {ef_construction}"
        )
    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": INSTALL_LOCK})
    if installed(conn):
        return 0
    conn.execute(text("CREATE EXTENSION IF NOT EXISTS vector"))
    conn.execute(text(_DECODE))
    conn.execute(text(_TABLE))
    conn.execute(text(_SCOPE_INDEX))
    conn.execute(text(_HNSW_INDEX.format(m=int(m), ef_construction=int(ef_construction))))
    conn.execute(text(_FOLLOW))
    conn.execute(text("DROP TRIGGER IF EXISTS cachegw_entry_vectors ON cache_entries"))
    conn.execute(text(_TRIGGER))
    filled = conn.execute(text(_BACKFILL)).rowcount
    if filled:
        log.info("pgvector: %d stored entries given their vectors", filled)
    return int(filled)
