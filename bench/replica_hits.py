"""Semantic-hit throughput of one gateway replica vs two on one pgvector database, and each replica's RSS.

Real ``cachegw serve`` processes (no built-in engine: hits never reach a backend; misses while seeding go
to testkit's small upstream, which answers at once) on ``[index] store = "pgvector"`` against a
throwaway PostgreSQL 18 (bench/pg_server.py). Seeded with --seeds real QQP questions through the
gateway, then filled to each --sizes entry count in the same scope with real corpus texts and their
MiniLM vectors (bench/faiss_lookup.py's cache; rows cloned from a seeded one, so they are entries the
gateway would serve). At each size: fresh replicas, their RSS once healthy, then --clients concurrent
clients sending reworded seed questions (each a semantic hit: an exact-tier miss that the shared index
answers) to one replica, then split across two, --seconds each, twice in turn.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.replica_hits --sizes 10000,100000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
from sqlalchemy import create_engine, insert, text

from bench.common import save, say
from bench.faiss_lookup import corpus, embed_cached, pick_queries
from bench.gateway_latency import MODEL, SYSTEM, start, stop, wait_health
from bench.pg_server import new_database, pg_server
from bench.shared_index import bulk_build
from cachegw.gateway.config import load_settings
from cachegw.gateway.storage.tables import CacheEntry
from testkit.servers import Upstream, free_port, pgvector_config, recording_upstream, serve_in_thread

VARIANTS = [
    "{q}",
    "{q} ?",
    "please, {q}",
    "quick question: {q}",
    "{q}??",
    "hey, {q}",
    "so, {q}",
    "{q} thanks",
]
COLUMNS = (
    "tenant, model, endpoint, scope, response, finish_reason, max_tokens, size_bytes, created_at, "
    "expires_at, prompt_tokens, completion_tokens, hit_count, bad"
)


def body(question: str) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": MODEL, "temperature": 0, "max_tokens": 16, "messages": messages}


def fill(database: str, texts: list[str], vecs: np.ndarray, upto: int) -> dict[str, float]:
    """Clone a seeded entry until the table holds ``upto`` entries, each with a real corpus text and its
    vector. Set-up, not the write path (bench/shared_index.py times that): the trigger is off meanwhile
    and the vectors are written as pgvector text, then the HNSW index is built once (timed)."""
    engine = create_engine(database)
    ix = load_settings().index
    with engine.begin() as conn:
        have = int(conn.execute(text("SELECT count(*) FROM cache_entries")).scalar_one())
        conn.execute(text("DROP INDEX IF EXISTS ix_entry_vectors_hnsw"))
        first = text(f"SELECT {COLUMNS} FROM cache_entries ORDER BY id LIMIT 1")
        template = conn.execute(first).one()._asdict()
    vector = text("INSERT INTO entry_vectors VALUES (:id, :scope, CAST(:v AS vector(384)))")
    t0 = time.perf_counter()
    for start_at in range(have, upto, 2000):
        stop_at = min(upto, start_at + 2000)
        rows = [
            template | {"exact_key": f"fill-{i}", "query_text": texts[i], "embedding": vecs[i].tobytes()}
            for i in range(start_at, stop_at)
        ]
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE cache_entries DISABLE TRIGGER cachegw_entry_vectors"))
            ids = conn.execute(
                insert(CacheEntry).returning(CacheEntry.id, sort_by_parameter_order=True), rows
            )
            literals = ("[" + ",".join(map(repr, vecs[i].tolist())) + "]" for i in range(start_at, stop_at))
            scope = template["scope"]
            conn.execute(
                vector, [{"id": i, "scope": scope, "v": v} for (i,), v in zip(ids, literals, strict=True)]
            )
            conn.execute(text("ALTER TABLE cache_entries ENABLE TRIGGER cachegw_entry_vectors"))
    filled = time.perf_counter() - t0
    built = bulk_build(engine, ix.hnsw_m, ix.ef_construction)
    engine.dispose()
    return {"insert_s": round(filled, 1), "hnsw_bulk_build_s": round(built, 1)}


def rss_mib(pid: int) -> float:
    proc = psutil.Process(pid)
    return round(sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20, 1)


async def drive(urls: list[str], questions: list[str], clients: int, seconds: float) -> dict[str, object]:
    """``clients`` loops, spread evenly over ``urls``, each sending the next reworded question."""
    work = itertools.cycle(v.format(q=q[0].lower() + q[1:]) for v in VARIANTS for q in questions)
    kinds: dict[str, int] = {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=60, limits=limits, headers={"Authorization": "Bearer bench"}) as c:
        stop_at = time.monotonic() + seconds

        async def worker(i: int) -> None:
            url = f"{urls[i % len(urls)]}/v1/chat/completions"
            while time.monotonic() < stop_at:
                r = await c.post(url, json=body(next(work)))
                kind = r.headers.get("x-cache", str(r.status_code))
                kinds[kind] = kinds.get(kind, 0) + 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker(i) for i in range(clients)))
        elapsed = time.monotonic() - t0
    hits = kinds.get("semantic-hit", 0)
    return {
        "rps": round(sum(kinds.values()) / elapsed, 1),
        "semantic_hits_per_s": round(hits / elapsed, 1),
    } | {"x_cache": kinds}


async def at_size(work: Path, cfg: Path, questions: list[str], args: argparse.Namespace) -> dict:
    ports = [free_port(), free_port()]
    exe = [sys.executable, "-m", "cachegw.gateway.cli", "serve", "--config", str(cfg)]
    procs = [
        start([*exe, "--port", str(p), "--data-dir", str(work / f"r{k}")], work / f"r{k}.log")
        for k, p in enumerate(ports)
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc in zip(urls, procs, strict=True):
            await wait_health(url, proc)
        rss = [rss_mib(p.pid) for p in procs]
        await drive(urls, questions, 4, 3)  # warm-up: encoder, connections
        runs: dict[str, list[dict]] = {"one_replica": [], "two_replicas": []}
        for _ in range(args.rounds):
            runs["one_replica"].append(await drive(urls[:1], questions, args.clients, args.seconds))
            runs["two_replicas"].append(await drive(urls, questions, args.clients, args.seconds))
            say(f"{runs}")
        return {"rss_mib_after_start": rss, "rss_mib_after_load": [rss_mib(p.pid) for p in procs]} | runs
    finally:
        for p in procs:
            stop(p)


async def seed(cfg: Path, work: Path, questions: list[str]) -> None:
    port = free_port()
    exe = [sys.executable, "-m", "cachegw.gateway.cli", "serve", "--config", str(cfg), "--port", str(port)]
    proc = start([*exe, "--data-dir", str(work / "seed")], work / "seed.log")
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_health(url, proc)
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": "Bearer bench"}) as c:
            for q in questions:
                (await c.post(f"{url}/v1/chat/completions", json=body(q))).raise_for_status()
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000")
    ap.add_argument("--seeds", type=int, default=256)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    queries = pick_queries(2000, 1000)
    questions = queries["para_partner"][: args.seeds]
    texts, _, _ = corpus(max(sizes), queries, first=10_000)
    vecs = embed_cached(texts, "corpus")
    results = {}
    with (
        pg_server() as server,
        tempfile.TemporaryDirectory(prefix="cgrh-") as tmp,
        serve_in_thread(recording_upstream(Upstream(model=MODEL))) as upstream,
    ):
        work, database = Path(tmp), new_database(server)
        cfg = pgvector_config(work, upstream, database)
        say(f"seeding {len(questions)} answers through a replica")
        asyncio.run(seed(cfg, work, questions))
        for size in sizes:
            say(f"filling to {size} entries")
            results[str(size)] = {"fill": fill(database, texts, vecs, size)}
            results[str(size)] |= asyncio.run(at_size(work, cfg, questions, args))
            say(f"{size}: {results[str(size)]}")
    save(
        "replica_hits",
        {"clients": args.clients, "seconds": args.seconds, "seeds": len(questions), "cpus": os.cpu_count()}
        | {"by_entries": results},
    )


if __name__ == "__main__":
    main()
