"""The bounded false-hit rate, measured: labelled pairs replayed through the real gateway in front of a
backend whose answers follow the labels (the same meaning gets the same answer), so whether a hit
was right is known, and so is what an audit will say.

Data: QQP pairs of the test split the verifier never trained on (``bench/verifier_quality.split_qqp``),
and banking77 (same intent = same answer). Per data set: today's static defaults, then targets of 2%
and 5%, each on a fresh gateway over the same replay. Reported: the hit rate, the realized false-hit
rate over the second half of the replay, the gateway's own estimate and interval at the end, the audit
cost as extra backend requests per 100 client requests, and realized vs target vs estimate along the
replay (bench/results/error_bound.json and .png).

    .venv/bin/python -m bench.error_bound [--pairs 400] [--texts 800] [--data DIR]
    .venv/bin/python -m bench.error_bound --prior [--pairs 1500] [--texts 800]

``--prior``: the shipped prior (``policies/artifacts/bound_prior.json``: its families weighed per scope)
against none and against the same counts as one mixed prior, target 5%, audits at 50%, no seeds; the
replay draws from the held-out part only (``bench/prior_split.py``), never from the pairs the prior
counted. Writes bench/results/error_bound_prior.json.

Subsampled (``--pairs`` QQP pairs, question 1 then 2; ``--texts`` banking77 texts of ``INTENTS``
intents; fixed seed; ``CLIENTS`` clients at once). Target runs start from evidence seeded as `cachegw
calibrate --seed-evidence` seeds it, from labelled pairs disjoint from the replay; audits add to it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from fastapi import FastAPI, Request

from bench.common import RESULTS, SHARED_DATA, save, say
from bench.prior_split import banking_parts, meanings, qqp_parts
from bench.relabel_meanings import relabelled_meanings
from bench.verifier_quality import split_qqp
from testkit.servers import serve_in_thread

MODEL = "labelled"
TOKEN = "bench-error-bound-admin-token"
CLIENT_KEY = {"authorization": "Bearer bench"}
TARGETS = (0.02, 0.05)
AUDIT_FRACTION = 0.25  # a quarter of hits and near misses: the seeds carry the start
PRIOR_TARGET, PRIOR_AUDITS = 0.05, 0.5  # the --prior runs
SEED_PAIRS = 2000  # QQP test pairs that seed the evidence (`cachegw calibrate --seed-evidence`)
INTENTS = 12  # banking77 intents of the replayed support desk
CLIENTS = 4  # replay units (a QQP pair in order, or one banking77 text) sent by 4 clients at once
SAMPLES = 40  # points of the plotted history per run
KEYS = ("estimate", "interval", "line", "audits", "evidence", "prior_audits", "prior_families")


def labelled_backend(answer_of: dict[str, str] | Callable[[dict[str, Any]], str]) -> FastAPI:
    """Answers each question with its meaning's label: same meaning, same answer. ``answer_of`` maps
    the last message's text to its label, or is a function of the whole request body."""
    answer = (
        answer_of if callable(answer_of) else lambda b: answer_of.get(b["messages"][-1]["content"], "unknown")
    )
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        words = len(str(body["messages"][-1]["content"]).split())
        return {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": answer(body)},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": words + 8, "completion_tokens": 3, "total_tokens": words + 11},
        }

    return app


Replay = tuple[list[list[str]], dict[str, str], tuple[list[str], list[str], np.ndarray]]


def qqp_order(
    data: Path, seed: int, held_out: bool = False
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(the test split, its pairs in the replay's order): the first ``--pairs`` are replayed.
    ``held_out``: only the part the shipped prior did not count (``bench/prior_split.py``)."""
    with open(data / "qqp_dev.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    _, test, _ = split_qqp(rows)
    pool = qqp_parts(rows)[1] if held_out else test
    return test, random.Random(seed).sample(pool, len(pool))


def qqp_replay(data: Path, pairs: int, seed: int, held_out: bool = False, labels: str = "qqp") -> Replay:
    """Test-split pairs, question 1 then question 2; meanings are the classes duplicates connect.
    Other test-split pairs (``SEED_PAIRS``, none sharing a replayed question) seed the evidence.
    ``held_out``: replayed pairs only from the part the shipped prior did not count. ``labels``:
    "qqp" (QQP's duplicate links) or "relabelled" (``bench/relabel_meanings.py``)."""
    test, shuffled = qqp_order(data, seed, held_out)
    picked = shuffled[:pairs]
    replayed = {q for r in picked for q in (r["question1"], r["question2"])}
    seeds = [r for r in shuffled[pairs:] if r["question1"] not in replayed and r["question2"] not in replayed]
    seeds = seeds[:SEED_PAIRS]
    # all of the test split's duplicates define meanings, not only the picked ones
    find = meanings(test) if labels == "qqp" else relabelled_meanings(test).find
    units = [[r["question1"], r["question2"]] for r in picked]
    labelled = (
        [r["question1"] for r in seeds],
        [r["question2"] for r in seeds],
        np.array([r["is_duplicate"] == "1" for r in seeds]),
    )
    # the whole meaning's name: a prefix would give meanings that share one ("... in Maine?" / "... in
    # Alaska?") one answer, and count their false hits right
    answer = {q: f"answer {hashlib.sha1(find(q).encode()).hexdigest()[:16]}" for u in units for q in u}
    return units, answer, labelled


def banking_replay(data: Path, texts: int, seed: int, held_out: bool = False) -> Replay:
    """A support desk with ``INTENTS`` intents (drawn at random): ``texts`` of their queries replayed in
    random order; the rest seed the evidence as nearest-neighbour pairs (same intent = right).
    ``held_out``: only texts the shipped prior did not count (no seeds are used then)."""
    from cachegw.gateway.offline.calibrate import gateway_encoder

    with open(data / "banking77_train.csv", newline="") as f:
        read = list(csv.DictReader(f))
    rows = {r["text"]: r["category"] for r in (banking_parts(read)[1] if held_out else read)}
    rng = random.Random(seed)
    intents = set(rng.sample(sorted(set(rows.values())), INTENTS))
    pool = rng.sample(
        sorted(t for t, c in rows.items() if c in intents), len([c for c in rows.values() if c in intents])
    )
    order, rest = pool[:texts], pool[texts:]
    if held_out:
        return [[t] for t in order], {t: f"intent {rows[t]}" for t in order}, ([], [], np.array([]))
    emb = gateway_encoder("auto").encode(rest)
    sims = emb @ emb.T
    np.fill_diagonal(sims, -1.0)
    nn = sims.argmax(axis=1)
    labelled = (
        list(rest),
        [rest[j] for j in nn],
        np.array([rows[t] == rows[rest[j]] for t, j in zip(rest, nn, strict=True)]),
    )
    return [[t] for t in order], {t: f"intent {rows[t]}" for t in order}, labelled


def seed_rows(labelled: tuple[list[str], list[str], np.ndarray]) -> list[Any]:
    """The labelled pairs as evidence rows, scored as `cachegw calibrate --seed-evidence` scores them."""
    from cachegw.gateway.cache.verifier_loader import load_verifier
    from cachegw.gateway.config import load_settings
    from cachegw.gateway.offline.evidence_seed import seed_scores
    from cachegw.gateway.request.tenants import key_hash
    from cachegw.gateway.storage.evidence_store import EvidenceRow

    s = load_settings(None)
    verifier = load_verifier(s.cache, s.engine.resolved_cache_dir)
    scores = seed_scores(labelled[0], labelled[1], s.canonicalize, verifier, s.cache.threshold)
    tenant = key_hash(CLIENT_KEY["authorization"].split()[1])
    now = time.time()
    return [
        EvidenceRow(MODEL, tenant, float(x), bool(y), "seed", now)
        for x, y in zip(scores, labelled[2], strict=True)
        if not np.isnan(x)
    ]


@contextlib.contextmanager
def gateway(
    backend: str,
    work: Path,
    target: float,
    seeds: list[Any],
    prior: str = "none",
    audits: float = AUDIT_FRACTION,
    over: dict[str, Any] | None = None,
) -> Iterator[str]:
    from cachegw.gateway.api.app import build_app
    from cachegw.gateway.compose import started_gateway
    from cachegw.gateway.config import load_settings

    s = load_settings(None, data_dir=str(work), backends=(backend,))
    cache = {
        "max_false_hit_rate": target,
        "audit_fraction": audits,
        "false_hit_prior": prior,
        "audit_max_per_second": 1000.0,
        "sync_interval_s": 0.0,
        **(over or {}),
    }
    s = s.model_copy(
        update={
            "cache": s.cache.updated(cache),
            "admin": s.admin.model_copy(update={"token": TOKEN}),
        }
    )
    if seeds:  # what `cachegw calibrate --seed-evidence` writes, before the gateway starts
        from cachegw.gateway.storage.evidence_store import EvidenceStore
        from cachegw.gateway.storage.store import Store

        store = Store(s.gateway.resolved_database_url(work))
        EvidenceStore(store.session).add(seeds)
        store.close()
    with serve_in_thread(build_app(lambda: started_gateway(s, progress=False)), lifespan="on") as url:
        yield url


def false_hit_view(client: httpx.Client, url: str) -> dict[str, Any]:
    r = client.get(
        f"{url}/admin/api/stats", params={"window": "1h"}, headers={"authorization": f"Bearer {TOKEN}"}
    )
    return r.json()["false_hit_rate"]


def run(
    units: list[list[str]],
    answer_of: dict[str, str],
    target: float,
    backend: str,
    seeds: list[Any],
    prior: str = "none",
    audits: float = AUDIT_FRACTION,
    over: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One replay on a fresh gateway: per request, whether it hit and whether the hit was right.
    ``over``: other [cache] settings of the gateway."""
    served: list[tuple[bool, bool]] = []  # (hit, right), in the order the answers came
    linked: list[bool] = []  # whether each hit served by a near-miss link was right
    history: list[dict[str, Any]] = []
    total = sum(len(u) for u in units)
    every = max(1, total // SAMPLES)
    lock = threading.Lock()
    start = time.perf_counter()
    with (
        tempfile.TemporaryDirectory() as work,
        gateway(backend, Path(work), target, seeds, prior, audits, over) as url,
        httpx.Client(timeout=120) as client,
    ):

        def sample() -> None:
            scope: dict[str, Any] = next(iter(false_hit_view(client, url)["by_scope"].values()), {})
            with lock:
                hits = [right for h, right in served if h]
                n = len(served)
            realized = hits.count(False) / len(hits) if hits else None
            history.append({"requests": n, "realized": realized, **{k: scope.get(k) for k in KEYS}})

        def replay(unit: list[str]) -> None:
            for q in unit:
                msgs = [{"role": "user", "content": q}]
                body = {"model": MODEL, "messages": msgs, "temperature": 0, "max_tokens": 16}
                r = client.post(f"{url}/v1/chat/completions", json=body, headers=CLIENT_KEY)
                hit = r.headers["x-cache"] == "semantic-hit"
                right = r.json()["choices"][0]["message"]["content"] == answer_of[q]
                with lock:
                    served.append((hit, right))
                    if r.headers.get("x-cache-reason") == "link":
                        linked.append(right)
                    due = target and len(served) % every == 0
                if due:
                    sample()

        with ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(replay, units))
        time.sleep(1.0)  # the last audits land
        view = false_hit_view(client, url)
    seconds = time.perf_counter() - start
    second = served[len(served) // 2 :]
    hits2 = [right for h, right in second if h]
    hits = [right for h, right in served if h]
    scope: dict[str, Any] = next(iter(view.get("by_scope", {}).values()), {}) if target else {}
    verdicts = view.get("audits_by_verdict", {})
    realized2 = hits2.count(False) / len(hits2) if hits2 else 0.0
    interval = scope.get("interval")
    return {
        "target": target,
        "requests": len(served),
        "seconds": round(seconds, 1),
        "hit_rate": round(len(hits) / len(served), 4),
        "false_hits": hits.count(False),
        "hit_rate_second_half": round(len(hits2) / len(second), 4),
        "false_hit_rate_realized_second_half": round(realized2, 4),
        "false_hits_second_half": hits2.count(False),
        "hits_second_half": len(hits2),
        "within_target": realized2 <= target if target else None,
        "estimate": scope.get("estimate"),
        "interval": interval,
        "interval_contains_realized": (interval[0] <= realized2 <= interval[1]) if interval else None,
        "line": scope.get("line"),
        "prior_audits_at_end": scope.get("prior_audits"),
        "prior_families_at_end": scope.get("prior_families"),
        "link_hits": len(linked),
        "link_hits_wrong": linked.count(False),
        "first_hit_at": next((i + 1 for i, (h, _) in enumerate(served) if h), None),
        "evidence": scope.get("evidence"),
        "audits_by_verdict": verdicts,
        "audit_backend_tokens": view.get("audit_backend_tokens"),
        # near misses are judged against the client's own fresh answer: only hit audits re-ask
        "audit_requests_per_100": round(100 * view.get("audit_backend_requests", 0) / len(served), 2),
        "history": history,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (name, runs) in zip(axes[0], results.items(), strict=True):
        for run_ in runs:
            if not run_["target"]:
                continue
            h = run_["history"]
            x = [p["requests"] for p in h]
            (line,) = ax.plot(x, [p["realized"] for p in h], label=f"realized (target {run_['target']:.0%})")
            ax.plot(x, [p["estimate"] for p in h], "--", color=line.get_color(), label="estimate")
            ax.axhline(run_["target"], color=line.get_color(), linestyle=":", label="target")
        ax.set_title(name)
        ax.set_xlabel("client requests")
        ax.set_ylabel("false-hit rate of hits (cumulative)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=400)
    p.add_argument("--texts", type=int, default=800)
    p.add_argument("--data", type=Path, default=SHARED_DATA)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--prior", action="store_true", help="the shipped prior against none, held-out pairs")
    p.add_argument(
        "--labels",
        choices=("qqp", "relabelled"),
        default="qqp",
        help="--prior: QQP's meanings, or both",
    )
    args = p.parse_args()
    if args.prior:
        from bench.prior_replay import prior_main

        return prior_main(args)
    sets = {
        "qqp_test": qqp_replay(args.data, args.pairs, args.seed),
        "banking77": banking_replay(args.data, args.texts, args.seed),
    }
    results: dict[str, Any] = {}
    for name, (units, answer_of, labelled) in sets.items():
        seeds = seed_rows(labelled)
        wrong = sum(not r.right for r in seeds)
        say(f"{name}: {len(seeds)} seeded candidate pairs of {len(labelled[2])} ({wrong} wrong)")
        with serve_in_thread(labelled_backend(answer_of)) as b:
            results[name] = []
            for target in (0.0, *TARGETS):
                r = run(units, answer_of, target, f"{b}/v1", seeds if target else [])
                r["seeded"] = len(seeds) if target else 0
                say(
                    f"{name} target {target:.0%}: hit rate {r['hit_rate']:.3f}, realized (2nd half) "
                    f"{r['false_hit_rate_realized_second_half']:.3f} of {r['hits_second_half']} hits, "
                    f"estimate {r['estimate']} {r['interval']} line {r['line']} evidence {r['evidence']}, "
                    f"audits/100 {r['audit_requests_per_100']} ({r['seconds']} s)"
                )
                results[name].append(r)
    plot(results, RESULTS / "error_bound.png")
    save("error_bound", {"args": {k: str(v) for k, v in vars(args).items()}, "results": results})


if __name__ == "__main__":
    main()
