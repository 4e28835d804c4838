"""Alembic's environment: always given a connection by ``storage/migrate.py`` (never a URL of its own)."""

from __future__ import annotations

from alembic import context

from cachegw.gateway.storage.tables import Base

connection = context.config.attributes["connection"]
# render_as_batch: generated migrations then alter SQLite tables by copying them, as SQLite needs
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
