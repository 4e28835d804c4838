"""Alembic migrations of the gateway's database (``gateway/storage/migrate.py`` runs them at start).

``versions/0001``-``0008`` rebuild the history from before Alembic: each is guarded (it adds only what
is missing) and says by ``applied`` whether a database already has it, so a database made by any earlier
cachegw is stamped at the revision it reached and upgraded from there.
"""
