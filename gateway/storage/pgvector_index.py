"""``VectorIndex`` in PostgreSQL with pgvector: one index every replica searches, none in memory.

The vectors live in ``entry_vectors`` (``pgvector_schema.py``), written by the database in the same
transaction as their entry and deleted with it or when it is flagged bad; so ``add`` and ``remove``
only repair what the trigger did not see, ``rebuild`` loads nothing, and a replica needs no sync for
the semantic tier: an answer one replica commits is a candidate for the next search on any other.

A search is one query: the scope's rows, nearest first by inner product (cosine of unit vectors,
the similarity ``embeddings.index.ScopedIndex`` returns), over the HNSW index with ``ef_search``
candidates and pgvector's iterative scan, so the scope filter cannot starve the results.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from sqlalchemy import Engine, bindparam, text
from sqlalchemy.exc import IntegrityError

from cachegw.embeddings.index_inputs import check_ids, check_scope, check_vecs
from cachegw.gateway.storage import pgvector_schema
from cachegw.gateway.storage.pgvector_schema import DIM, TABLE


class PgVectorError(RuntimeError):
    """The database cannot hold the pgvector index (not PostgreSQL, no extension, wrong width)."""


def _literal(vec: np.ndarray) -> str:
    """pgvector's text form; float32 -> Python float -> repr is exact."""
    return "[" + ",".join(map(repr, vec.astype(np.float32).tolist())) + "]"


class PgVectorIndex:
    """Nearest neighbours per scope in ``entry_vectors``; thread-safe (each call takes a connection)."""

    def __init__(
        self, engine: Engine, dim: int = DIM, ef_search: int = 64, m: int = 16, ef_construction: int = 64
    ) -> None:
        """Installs the schema where it is missing (``pgvector_schema.install``, with ``m`` and
        ``ef_construction`` for a new HNSW index)."""
        if engine.dialect.name != "postgresql":
            raise PgVectorError(f'[index] store = "pgvector" needs PostgreSQL, not {engine.dialect.name}')
        if dim != DIM:
            raise PgVectorError(f"the pgvector index holds {DIM}-dim embeddings; the encoder makes {dim}")
        if ef_search <= 0:
            raise ValueError(f"ef_search must be positive, got {ef_search}")
        self.engine, self.dim, self.ef_search = engine, dim, ef_search
        with engine.begin() as conn:
            if not pgvector_schema.installed(conn):
                if not pgvector_schema.available(conn):
                    raise PgVectorError(
                        "the PostgreSQL server has no pgvector extension (install postgresql-NN-pgvector)"
                    )
                pgvector_schema.install(conn, m, ef_construction)

    def add(self, scope: str, ids: np.ndarray, vecs: np.ndarray) -> None:
        """Write vectors of existing, unflagged entries (the trigger normally has); others are skipped."""
        check_scope(scope)
        vecs = check_vecs(vecs, self.dim)
        ids = check_ids(ids, vecs.shape[0])
        rows = [{"id": int(i), "scope": scope, "v": _literal(v)} for i, v in zip(ids, vecs, strict=True)]
        if not rows:
            return
        query = text(
            f"INSERT INTO {TABLE} (entry_id, scope, embedding) "
            f"SELECT c.id, :scope, CAST(:v AS vector({DIM})) FROM cache_entries AS c "
            "WHERE c.id = :id AND NOT c.bad ON CONFLICT (entry_id) DO NOTHING"
        )
        try:
            with self.engine.begin() as conn:
                conn.execute(query, rows)
        except IntegrityError:  # an entry deleted meanwhile by another replica: nothing to index
            pass

    def remove(self, ids: Iterable[int]) -> int:
        """Delete the vectors of ``ids`` (usually gone already with their entries); how many were."""
        wanted = [int(i) for i in ids]
        if not wanted:
            return 0
        query = text(f"DELETE FROM {TABLE} WHERE entry_id IN :ids").bindparams(
            bindparam("ids", expanding=True)
        )
        with self.engine.begin() as conn:
            return int(conn.execute(query, {"ids": wanted}).rowcount)

    def search(self, scope: str, vec: np.ndarray, k: int = 1) -> list[tuple[int, float]]:
        """Up to ``k`` (entry id, cosine) of ``scope``, best first; [] for an unknown or empty scope."""
        check_scope(scope)
        if isinstance(vec, np.ndarray) and vec.ndim == 1:
            vec = vec[None, :]
        query_vec = check_vecs(vec, self.dim, "query vector")
        if query_vec.shape[0] != 1:
            raise ValueError(f"search takes one query vector, got {query_vec.shape[0]}")
        if not isinstance(k, int | np.integer) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        settings = text(
            "SELECT set_config('hnsw.ef_search', :ef, true), "
            "set_config('hnsw.iterative_scan', 'relaxed_order', true)"
        )
        query = text(
            f"SELECT entry_id, -(embedding <#> CAST(:q AS vector({DIM}))) AS sim FROM {TABLE} "
            f"WHERE scope = :scope ORDER BY embedding <#> CAST(:q AS vector({DIM})) LIMIT :k"
        )
        with self.engine.begin() as conn:
            conn.execute(settings, {"ef": str(max(self.ef_search, int(k)))})
            rows = conn.execute(query, {"q": _literal(query_vec[0]), "scope": scope, "k": int(k)}).all()
        # relaxed_order may return neighbours slightly out of order: sort the few there are
        return sorted(((int(i), float(s)) for i, s in rows), key=lambda r: -r[1])

    def rebuild(
        self, items: Iterable[tuple[str, int, np.ndarray]], total: int | None = None, progress: bool = True
    ) -> None:
        """Nothing to load: the vectors are in the database (``items`` is not read)."""

    def __len__(self) -> int:
        """The vectors every replica searches (a count in the database)."""
        with self.engine.connect() as conn:
            return int(conn.execute(text(f"SELECT count(*) FROM {TABLE}")).scalar() or 0)

    def __contains__(self, entry_id: object) -> bool:
        if not isinstance(entry_id, int | np.integer):
            return False
        with self.engine.connect() as conn:
            found = conn.execute(text(f"SELECT 1 FROM {TABLE} WHERE entry_id = :i"), {"i": int(entry_id)})
            return found.first() is not None
