"""Alembic migrations: a database of every schema cachegw shipped, with rows in it, is upgraded when a
``Store`` opens it; its rows survive and its schema then matches the models exactly.

The shapes come from git history (tests/historic_schemas.py), on SQLite and on a real PostgreSQL
(the session's server, ``postgres`` in tests/conftest.py).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, MetaData, create_engine, insert, inspect, select, text

from cachegw.gateway.storage import migrate
from cachegw.gateway.storage.store import Store, sql_stores
from cachegw.gateway.storage.tables import Base, BigId, CacheEntry, ChangeRow
from tests.historic_schemas import SHAPES, shape
from tests.test_shared_store import fresh_database

NOW = 1_800_000_000.0


def entry_row(md: MetaData, entry_id: int, key: str, answer: str) -> dict[str, Any]:
    row: dict[str, Any] = dict(
        id=entry_id, tenant="t", model="m", endpoint="chat", scope="s", exact_key=key,
        query_text=f"question {key}", embedding=b"\x00\x00\x80?", response=answer, finish_reason="stop",
        max_tokens=16, prompt_tokens=3, completion_tokens=2, size_bytes=len(answer),
        created_at=NOW + entry_id, last_hit_at=None, hit_count=1, expires_at=NOW + 3600, bad=False,
    )  # fmt: skip
    if "threshold" in md.tables["cache_entries"].c:
        row["threshold"] = 0.9
    return row


def request_row(md: MetaData) -> dict[str, Any]:
    row: dict[str, Any] = {"id": "req-1", "ts": NOW, "tenant": "t", "model": "m", "endpoint": "chat",
                           "stream": False, "cache_result": "miss", "similarity": 0.5, "rules_fired": "",
                           "total_ms": 12.5, "status": 200, "error": None}  # fmt: skip
    extra = {"response_id": "chatcmpl-1", "backend": "http://b/v1", "reason": "no-candidate", "volatile": "x"}
    return row | {k: v for k, v in extra.items() if k in md.tables["requests"].c}


def fill(engine: Engine, md: MetaData) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The historic tables with rows: a request, a reply, and entries; where the shape has no unique
    live-key index, the key ``a`` has an older copy (id 1) that the upgrade must retire; where it has the
    deletion log, entry 7 was deleted."""
    md.create_all(engine)
    copies = "ux_entries_live_key" not in {i.name for i in md.tables["cache_entries"].indexes}
    entries = [entry_row(md, 2, "a", "answer a"), entry_row(md, 3, "b", "answer b")]
    with engine.begin() as conn:
        if copies:
            conn.execute(insert(md.tables["cache_entries"]), [entry_row(md, 1, "a", "old answer a")])
        conn.execute(insert(md.tables["cache_entries"]), entries)
        conn.execute(insert(md.tables["requests"]), [request_row(md)])
        conn.execute(insert(md.tables["replies"]), [{"key": "k", "text": "reply", "created_at": NOW}])
        top = 3
        if "entry_deletions" in md.tables:  # a newer entry, deleted since (its id must not come back)
            conn.execute(insert(md.tables["entry_deletions"]), [{"entry_id": 7, "size_bytes": 1, "ts": NOW}])
            top = 7
        # as if the ids had come from the sequence
        if engine.dialect.name == "postgresql":
            conn.execute(text(f"SELECT setval(pg_get_serial_sequence('cache_entries', 'id'), {top})"))
        elif md.tables["cache_entries"].kwargs.get("sqlite_autoincrement"):
            conn.execute(text(f"UPDATE sqlite_sequence SET seq = {top} WHERE name = 'cache_entries'"))
    return request_row(md), entries


def schema_diff(engine: Engine) -> list:
    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn), Base.metadata)


def assert_64_bit_ids(engine: Engine) -> None:
    """On PostgreSQL every id column the models make BIGINT is bigint, and so are the sequences behind
    the serial keys (a serial's sequence stops at 2^31 - 1 otherwise); SQLite's INTEGER is 64-bit."""
    if engine.dialect.name != "postgresql":
        return
    wanted = {(t.name, c.name) for t in Base.metadata.tables.values() for c in t.c if c.type is BigId}
    assert ("cache_entries", "id") in wanted and ("hit_audits", "entry_id") in wanted
    with engine.connect() as conn:
        types = dict(
            ((t, c), ty)
            for t, c, ty in conn.execute(
                text("SELECT table_name, column_name, data_type FROM information_schema.columns")
            )
        )
        sequences = dict(conn.execute(text("SELECT sequencename, data_type FROM pg_sequences")).all())
        serials = [
            conn.execute(text(f"SELECT pg_get_serial_sequence('{t}', 'id')")).scalar()
            for t, c in sorted(wanted)
            if c == "id"
        ]
    assert {k: types[k] for k in wanted} == dict.fromkeys(wanted, "bigint")
    assert serials and all(sequences[s.removeprefix("public.")] == "bigint" for s in serials)


def check_upgrade(url: str, name: str) -> None:
    md = shape(name)
    engine = create_engine(url)
    try:
        request, entries = fill(engine, md)
        deleted = "entry_deletions" in md.tables
        store = Store(url, clock=lambda: NOW)
        stores = sql_stores(store)
        try:
            got = stores.entries.get_entries([1, 2, 3])
            assert sorted(got) == [2, 3]  # the older copy of key a retired, the rest kept
            for row in entries:
                assert {k: getattr(got[row["id"]], k) for k in row} == row
            assert [e.id for e in stores.entries.find_exact("t", "m", "a", NOW)] == [2]
            with engine.connect() as conn:
                kept = conn.execute(select(*[text(k) for k in request]).select_from(text("requests"))).one()
                assert dict(zip(request, kept, strict=True)) == request
                assert stores.replies.lookup_reply("k") == "reply"
                version = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
            assert version == migrate.head()
            assert "entry_deletions" not in inspect(engine).get_table_names()  # the change log's now
            assert schema_diff(engine) == []
            assert_64_bit_ids(engine)
            # and the store works on it: a new entry gets a new id, the key rule holds
            new = CacheEntry(**(entry_row(Base.metadata, 0, "a", "newer a") | {"id": None}))
            new_id, replaced = stores.entries.put_entry(new)
            assert new_id > (7 if deleted else 3) and [i for i, _ in replaced] == [2]
            with store.session() as s:  # and other replicas learn of both, in commit order
                logged = s.execute(select(ChangeRow.kind, ChangeRow.entry_id).order_by(ChangeRow.id)).all()
            assert [tuple(r) for r in logged] == [("delete", 2), ("store", new_id)]
        finally:
            store.close()
        if engine.dialect.name == "sqlite":  # ids are never reused now, whatever the shape began with
            with engine.connect() as conn:
                sql = conn.execute(text("SELECT sql FROM sqlite_master WHERE name = 'cache_entries'"))
                sql = sql.scalar()
            assert "AUTOINCREMENT" in str(sql)
    finally:
        engine.dispose()


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_shipped_schema_is_upgraded_on_sqlite(name: str, tmp_path: Path) -> None:
    check_upgrade(f"sqlite:///{tmp_path / 'old.db'}", name)


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_shipped_schema_is_upgraded_on_postgresql(name: str, postgres: str) -> None:
    check_upgrade(fresh_database(postgres), name)


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_the_revisions_alone_build_the_models_schema(dialect: str, tmp_path: Path, request) -> None:
    """What ``make migration`` diffs against: a new table in gateway/storage/tables.py without its revision
    fails here."""
    url = f"sqlite:///{tmp_path / 'new.db'}"
    if dialect == "postgresql":
        url = fresh_database(request.getfixturevalue("postgres"))
    engine = create_engine(url)
    try:
        migrate.upgrade(engine, create_new=False)
        assert schema_diff(engine) == []
        assert_64_bit_ids(engine)
    finally:
        engine.dispose()


def test_replicas_starting_at_once_upgrade_an_old_database_once(postgres: str) -> None:
    """Four stores open one pre-Alembic database together: the advisory lock lets one upgrade it and
    the others find it done (without it, two would add the same column and one would fail)."""
    url = fresh_database(postgres)
    engine = create_engine(url)
    fill(engine, shape("first"))
    engine.dispose()
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def start() -> None:
        barrier.wait()
        try:
            Store(url).close()
        except BaseException as exc:  # noqa: BLE001 - the test reports any
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    engine = create_engine(url)
    try:
        assert schema_diff(engine) == []
    finally:
        engine.dispose()
