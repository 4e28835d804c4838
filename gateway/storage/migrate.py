"""Bring a database to the schema of ``gateway/storage/tables.py`` with Alembic, once at each start.

A new database gets the tables at once and is stamped at the newest revision; one at an older
revision is upgraded; one made before cachegw used Alembic (no ``alembic_version`` table) is stamped
at the last revision whose changes it already has (each of those revisions says so: ``applied``) and
upgraded from there. On PostgreSQL the whole check runs under an advisory lock, so replicas starting
together upgrade once, one after the other. The scripts ship inside the package (``migrations/``).

``python -m cachegw.gateway.storage.migrate "what changed"`` (``make migration m="..."``) writes the next
revision: the differences between the models and a database built by the existing revisions.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, func, inspect, select

from cachegw.gateway.storage.tables import Base

SCRIPTS = "cachegw.gateway.storage:migrations"
# pg_advisory_lock key held while a replica checks and upgrades the schema (any fixed 64-bit number)
UPGRADE_LOCK = 0x63616368_65677701
OUR_TABLES = ("cache_entries", "requests", "replies")


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic's config in code (no alembic.ini): the packaged scripts and the connection to use."""
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPTS)
    cfg.attributes["connection"] = connection
    return cfg


@functools.cache
def scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head() -> str:
    rev = scripts().get_current_head()
    assert rev is not None, "no migration scripts found"
    return rev


@contextlib.contextmanager
def _upgrade_lock(conn: Connection) -> Iterator[None]:
    """One replica at a time (PostgreSQL; a session lock, released on error or disconnect too)."""
    if conn.dialect.name != "postgresql":
        yield
        return
    conn.execute(select(func.pg_advisory_lock(UPGRADE_LOCK)))
    conn.commit()
    try:
        yield
    finally:
        conn.rollback()
        conn.execute(select(func.pg_advisory_unlock(UPGRADE_LOCK)))
        conn.commit()


def legacy_revision(conn: Connection) -> str | None:
    """The revision a database made before Alembic has reached: the last of the revisions, in order,
    that it already has (None: not even the first, so nothing of ours is there)."""
    insp = inspect(conn)
    reached = None
    for script in reversed(list(scripts().walk_revisions())):  # oldest first
        applied = getattr(script.module, "applied", None)
        if applied is None or not applied(insp):
            break
        reached = script.revision
    return reached


def upgrade(engine: Engine, *, create_new: bool = True) -> None:
    """Upgrade the database to the newest revision. ``create_new``: a database with none of our
    tables gets them from the models in one step (else the revisions build it, as for writing a new one)."""
    with engine.connect() as conn, _upgrade_lock(conn):
        context = MigrationContext.configure(conn)
        current = context.get_current_revision()
        if current is None:
            if create_new and not any(inspect(conn).has_table(t) for t in OUR_TABLES):
                Base.metadata.create_all(conn)
                context.stamp(scripts(), head())
                conn.commit()
                return
            if (reached := legacy_revision(conn)) is not None:
                context.stamp(scripts(), reached)
                current = reached
        conn.commit()
        if current != head():
            command.upgrade(alembic_config(conn), "head")
            conn.commit()


def new_revision(message: str, versions: Path | None = None) -> Path:
    """Write the next revision (numbered after the newest) from what the models add to the schema the
    existing revisions build; its path. Review it before committing: autogenerate misses renames."""
    with tempfile.TemporaryDirectory() as tmp:
        engine = create_engine(f"sqlite:///{tmp}/schema.db")
        try:
            upgrade(engine, create_new=False)
            with engine.connect() as conn:
                cfg = alembic_config(conn)
                if versions is not None:
                    cfg.set_main_option("version_locations", str(versions))
                rev_id = f"{int(head()) + 1:04d}" if head().isdigit() else None
                script = command.revision(cfg, message=message, autogenerate=True, rev_id=rev_id)
        finally:
            engine.dispose()
    assert script is not None and not isinstance(script, list)
    path = Path(script.path)
    for fix in (["format"], ["check", "--fix", "--quiet"]):  # the project's style, where ruff is installed
        subprocess.run([sys.executable, "-m", "ruff", *fix, str(path)], capture_output=True, check=False)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].strip():
        sys.exit('usage: python -m cachegw.gateway.storage.migrate "what the new revision changes"')
    print(f"wrote {new_revision(sys.argv[1])}")
