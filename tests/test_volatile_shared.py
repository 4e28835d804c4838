"""Learned volatile templates shared through the database, on SQLite and PostgreSQL: a template one
replica learns is applied by another once the change log names it, and by one started later without
any traffic (the same canonical body, so the same cache key); replicas learning one template at once
leave one row; tenants never share one; a row that is not a template is skipped with a log line.

The learner tests use the real learner on real stores (each replica its own ``Store``, as each gateway
process has); the last test runs three real gateways on one database in front of the real engine."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from cachegw.gateway.request.volatile_learner import VolatileLearner
from cachegw.gateway.storage.changes import ChangeKind, SqlChanges
from cachegw.gateway.storage.store import Store
from cachegw.gateway.storage.tables import VolatileTemplate
from cachegw.gateway.storage.volatile_store import StoredTemplate, VolatileStore
from cachegw.policies.cache_keys import request_keys
from cachegw.policies.canonicalize import Canonical
from cachegw.policies.canonicalize_config import CanonicalizeConfig
from tests.test_gateway import backend_url, chat, gateway  # noqa: F401
from tests.test_shared_store import eventually, on_database, shared_url  # noqa: F401
from tests.test_volatile_gateway import learned_with, logged, system
from tests.test_volatile_learning import body, varied

CFG = CanonicalizeConfig()  # type: ignore[call-arg]  # pydantic defaults


@pytest.fixture
def stores(shared_url: str) -> Iterator[list[Store]]:  # noqa: F811
    """Three replicas' stores on one database (the first one to open it migrates it)."""
    opened = [Store(shared_url) for _ in range(3)]
    yield opened
    for s in opened:
        s.close()


def replica(store: Store) -> VolatileLearner:
    return VolatileLearner(store=VolatileStore(store.session))


class Follows:
    """What a gateway's ``ReplicaSync`` does for its learner (gateway/cache/sync.py): read the change
    log on from where it stood when the learner loaded, and hand on the templates it names; then store
    the learner's match counts, as the sync chore does."""

    def __init__(self, store: Store, learner: VolatileLearner) -> None:
        self.changes, self.learner = SqlChanges(store.engine), learner
        self.cursor = self.changes.start()

    def sync(self) -> None:
        batch = self.changes.read(self.cursor)
        self.cursor = batch.cursor
        named = [c.entry_id for c in batch.changes if c.kind is ChangeKind.TEMPLATE and c.entry_id]
        asyncio.run(self.learner.logged(named))
        asyncio.run(self.learner.flush_matches())


def canonical(learner: VolatileLearner, tenant: str, system_prompt: str, learn: bool = True) -> Canonical:
    return asyncio.run(learner.canonicalize(tenant, body(system_prompt), CFG, lambda _: None, learn))


def teach(learner: VolatileLearner, tenant: str, prompts: list[str]) -> str:
    """Requests until the learner has a template; its id."""
    for p in prompts:
        canonical(learner, tenant, p)
    (template,) = learner.templates(tenant)
    return template.id


def rows(store: Store) -> int:
    with store.session() as s:
        return int(s.scalar(select(func.count()).select_from(VolatileTemplate)) or 0)


def test_a_template_one_replica_learns_applies_on_every_replica(stores: list[Store]) -> None:
    a, b = replica(stores[0]), replica(stores[1])
    follows_b = Follows(stores[1], b)
    assert b.load() == 0
    prompts = varied(11, 4)
    tid = teach(a, "t1", prompts[:3])
    assert rows(stores[0]) == 1
    want = canonical(a, "t1", prompts[3], learn=False)
    assert [m.name for m in want.moved] and {m.name for m in want.moved} == {tid}
    # before it reads the log B keeps the values in the prompt: another body, another key (a miss)
    before = canonical(b, "t1", prompts[3], learn=False)
    assert before.body != want.body
    follows_b.sync()
    c = replica(stores[2])
    assert c.load() == 1  # started afterwards, no traffic at all
    for other in (b, c):
        got = canonical(other, "t1", prompts[3], learn=False)
        assert got.body == want.body
        assert request_keys("t1", "m", "chat", got.body) == request_keys("t1", "m", "chat", want.body)
        assert other.sample_count("t1") == 0  # applied, not learned again
    # match counts reach the row on A's next sync, and a replica started later reads them
    asyncio.run(a.flush_matches())
    d = replica(stores[2])
    d.load()
    (view,) = d.view()["t1"]  # A's: the request it was learned from (applied at once) and the next
    assert view.id == tid and view.matches == 2 and view.last_match_at is not None


def test_replicas_learning_one_template_at_once_leave_one_row(stores: list[Store]) -> None:
    learners = [replica(s) for s in stores]
    follows = [Follows(s, x) for s, x in zip(stores, learners, strict=True)]
    prompts = varied(12, 3)
    barrier = threading.Barrier(len(learners))
    errors: list[BaseException] = []
    ids: list[str] = []

    def learn(learner: VolatileLearner) -> None:
        try:
            barrier.wait()
            ids.append(teach(learner, "t1", prompts))
        except BaseException as exc:  # noqa: BLE001 - the test reports any
            errors.append(exc)

    threads = [threading.Thread(target=learn, args=(x,)) for x in learners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(set(ids)) == 1 and len(ids) == 3
    assert rows(stores[0]) == 1
    for f in follows:  # each reads back the one row: nothing new
        f.sync()
        assert [t.id for t in f.learner.templates("t1")] == ids[:1]


def test_tenants_never_share_a_template(stores: list[Store]) -> None:
    a, b = replica(stores[0]), replica(stores[1])
    follows_b = Follows(stores[1], b)
    prompts = varied(13, 4)
    tid = teach(a, "t1", prompts[:3])
    teach(a, "t2", prompts[:3])  # t2 learns the same prompts: its own row
    assert rows(stores[0]) == 2
    c = replica(stores[2])
    c.load()
    follows_b.sync()
    for x in (b, c):
        assert [t.id for t in x.templates("t1")] == [tid] == [t.id for t in x.templates("t2")]
        assert x.templates("t3") == ()
        # a tenant that learned nothing moves nothing, whatever the others learned
        alone = canonical(x, "t3", prompts[3], learn=False)
        assert alone.moved == () and alone.body["messages"][0]["content"] == prompts[3]


def test_a_row_that_is_not_a_template_is_skipped_with_a_log_line(
    stores: list[Store], caplog: pytest.LogCaptureFixture
) -> None:
    a = replica(stores[0])
    prompts = varied(14, 4)
    tid = teach(a, "t1", prompts[:3])
    b = replica(stores[1])
    follows_b = Follows(stores[1], b)
    b.load()
    bad = [
        StoredTemplate("t1", "0123456789", "{not json", 1.0),
        StoredTemplate("t1", "abcdef0123", '{"format": 99, "parts": ["a", "b"]}', 1.0),
        StoredTemplate("t1", "fedcba9876", '{"format": 1, "parts": ["x"], "max_value_chars": 64}', 1.0),
        # well formed, but its parts are another template: never applied under this id
        StoredTemplate("t2", "0000000000", '{"format": 1, "parts": ["a ", "b"], "max_value_chars": 64}', 1.0),
    ]
    VolatileStore(stores[0].session).add(bad)
    with caplog.at_level(logging.WARNING, logger="cachegw.volatile"):
        follows_b.sync()
        c = replica(stores[2])
        assert c.load() == 5
    skipped = [r for r in caplog.records if "skipped stored volatile template" in r.getMessage()]
    assert len(skipped) == 8  # each bad row once as B reads the log, once by C's load
    for x in (b, c):
        assert [t.id for t in x.templates("t1")] == [tid] and x.templates("t2") == ()
        assert canonical(x, "t1", prompts[3], learn=False).body == canonical(a, "t1", prompts[3], False).body


def test_replicas_share_learned_spans_through_the_gateway(backend_url: str, tmp_path: Path) -> None:  # noqa: F811
    """Gateway A learns from three requests; B (running) and C (started afterwards) each get one
    request with new values and find A's answer by its exact key: they canonicalized it as A did."""
    db = tmp_path / "shared.db"
    url_db = f"sqlite:///{db}"
    salt = uuid.uuid4().hex[:8]
    ask = [{"role": "user", "content": "Order status?"}]

    def prompt(tier: str, account: int) -> list[dict]:
        return [system(tier, account, salt), *ask]

    s_a = on_database(tmp_path / "a", backend_url, url_db, sync_interval_s=0.2)
    s_b = on_database(tmp_path / "b", backend_url, url_db, sync_interval_s=0.2)
    with gateway(s_a) as a, gateway(s_b) as b:
        for i, tier in enumerate(["GOLD", "SILVER", "BRONZE"]):
            assert chat(a, prompt(tier, 4711 + i), max_tokens=2)[1]["x-cache"] == "miss"
        (template,) = learned_with(a, salt)
        eventually(lambda: bool(learned_with(b, salt)))
        _, h, _ = chat(a, prompt("PLATINUM", 9000), max_tokens=2)
        assert h["x-cache"] == "miss"
        _, h, _ = chat(b, prompt("PLATINUM", 9000), max_tokens=2)
        assert h["x-cache"] == "exact-hit"
        row = logged(str(db), h["x-request-id"])
        assert row is not None and f"learned:{template['id']}" in (row[0] or "")
    with gateway(on_database(tmp_path / "c", backend_url, url_db)) as c:
        assert [t["id"] for t in learned_with(c, salt)] == [template["id"]]
        _, h, _ = chat(c, prompt("PLATINUM", 9000), max_tokens=2)
        assert h["x-cache"] == "exact-hit"
