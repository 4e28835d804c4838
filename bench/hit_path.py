"""Exact or semantic hits through real HTTP: this checkout's gateway against an earlier commit's, interleaved.

Each side is a `cachegw serve` process on this machine in front of the same small OpenAI-compatible
upstream (testkit's: a hit never reaches it, and it answers the seeding misses at once), seeded with
the same 40 answers, then asked to repeat them: one client at a time (latency), and 32 connections from
wrk, a C load generator (throughput: a Python client would be the bottleneck here). The two sides take
turns round by round, so the machine's drift hits both. The earlier commit runs as it was installed
then: uvicorn on asyncio and h11 when its pyproject.toml does not name uvloop (uvloop and httptools are
hidden from it).

    .venv/bin/python -m bench.hit_path [--base ca0af8e] [--rounds 3] [--seconds 8] [--semantic]

``--semantic`` asks each stored question re-typed (first letter lower-cased, " ?" appended: what a
second user types, an exact-tier miss), so every answer is a semantic hit: query embedding, index,
alignment and verifier. Results go to bench/results/hit_path_semantic.json. The re-typed questions are
repeats: after its first asking each one's vector and cross-encoder score are kept (``[cache]
model_memo_entries``), so a gateway with that memo runs no model for them; ``--this-config
'[cache]\nmodel_memo_entries = 0\n'`` measures this side as a paraphrase never seen before costs.

Needs `wrk` (Debian: `apt-get install wrk`) for the throughput part; without it only latency is taken.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common import ROOT, pct, save, say
from testkit.servers import Upstream, free_port, recording_upstream, serve_in_thread

QUESTIONS = [f"How do I reset my password for account type {i}?" for i in range(40)]
RETYPED = [q[0].lower() + q[1:] + " ?" for q in QUESTIONS]  # as bench.gateway_latency.paraphrase
WRK_SCRIPT = """
local bodies = {}
local i = 0
init = function(args)
  for k = 0, 39 do
    bodies[#bodies + 1] = '{"model":"m","messages":[{"role":"user","content":"HOW do I reset my password '
      .. 'for account type ' .. k .. '?TAIL"}],"temperature":0,"max_tokens":16}'
  end
end
request = function()
  i = i + 1
  return wrk.format("POST", "/v1/chat/completions", {["Content-Type"] = "application/json"},
    bodies[(i % #bodies) + 1])
end
"""
# the earlier commit as installed then: no uvloop, no httptools (uvicorn falls back to asyncio and h11)
HIDDEN = "import sys; sys.modules['uvloop'] = None; sys.modules['httptools'] = None; "


def body(question: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": 16}  # fmt: skip


@dataclass
class Side:
    name: str
    checkout: Path
    url: str
    proc: subprocess.Popen


def start(
    name: str, checkout: Path, upstream: str, work: Path, hide: bool, port: int = 0, extra: str = ""
) -> Side:
    """`cachegw serve` from ``checkout`` (the module path of its day: cachegw.gateway.cli or gateway.cli)."""
    module = "cachegw.gateway.cli" if (checkout / "cachegw").is_dir() else "gateway.cli"
    port = port or free_port()
    config = work / f"{name}.toml"
    config.write_text(f'[gateway]\nbackends = ["{upstream}/v1"]\n' + extra.replace("\\n", "\n"))
    args = ["serve", "--port", str(port), "--config", str(config), "--data-dir", str(work / name)]
    run = f"{HIDDEN if hide else 'import sys; '}sys.argv = ['cachegw', *{args!r}]; "
    run += f"from {module} import main; main()"
    env = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1"}
    log = (work / f"{name}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", run], cwd=checkout, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited: see {work / f'{name}.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code in (200, 503):
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    for q in QUESTIONS:  # seed: misses answered by the upstream, then stored
        httpx.post(f"{url}/v1/chat/completions", json=body(q), timeout=60).raise_for_status()
    r = httpx.post(f"{url}/v1/chat/completions", json=body(QUESTIONS[0]), timeout=60)
    assert r.headers.get("x-cache") == "exact-hit", r.headers
    return Side(name, checkout, url, proc)


def wrk_script(semantic: bool) -> str:
    """The wrk script asking the stored questions (exact hits) or their re-typed forms (semantic hits)."""
    return WRK_SCRIPT.replace("HOW", "how" if semantic else "How").replace("TAIL", " ?" if semantic else "")


def latency_ms(side: Side, n: int, semantic: bool) -> list[float]:
    """One request at a time, keep-alive (what a single client sees)."""
    out = []
    asks, want = (RETYPED, "semantic-hit") if semantic else (QUESTIONS, "exact-hit")
    with httpx.Client(timeout=60) as c:
        for i in range(n):
            t = time.perf_counter()
            r = c.post(f"{side.url}/v1/chat/completions", json=body(asks[i % len(asks)]))
            out.append((time.perf_counter() - t) * 1e3)
            assert r.headers.get("x-cache") == want, (want, r.headers.get("x-cache-reason"))
    return out


def throughput(side: Side, seconds: int, script: Path) -> tuple[float, float]:
    """wrk, one thread, 32 connections: (requests/s, p50 ms under that load)."""
    cmd = ["wrk", "-t1", "-c32", f"-d{seconds}s", "--latency", "-s", str(script), side.url]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[p50.group(2)]  # type: ignore[union-attr]
    return rps, float(p50.group(1)) * scale  # type: ignore[union-attr]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="ca0af8e", help="the earlier commit (git rev)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=300, help="sequential requests per latency round")
    ap.add_argument("--semantic", action="store_true", help="re-typed questions: semantic hits")
    ap.add_argument("--this-config", default="", help="TOML added to this side's config (\\n: newline)")
    ap.add_argument("--out", default="", help="result name under bench/results/")
    ap.add_argument("--port", type=int, default=0, help="base port (this side: +1); 0: any")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cachegw-hit-path-"))
    base = work / "base"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.base], cwd=ROOT, check=True)
    script = work / "hits.lua"
    script.write_text(wrk_script(args.semantic))
    has_wrk = shutil.which("wrk") is not None
    sides: list[Side] = []
    results: dict[str, dict[str, list[float]]] = {}
    try:
        with serve_in_thread(recording_upstream(Upstream(model="m"))) as upstream:
            old_loop = "uvloop" not in (base / "pyproject.toml").read_text()
            this_port = args.port + 1 if args.port else 0
            sides = [
                start("base", base, upstream, work, old_loop, args.port),
                start("this", ROOT, upstream, work, False, this_port, args.this_config),
            ]
            for side in sides:
                latency_ms(side, 50, args.semantic)  # warm-up
                results[side.name] = {"p50_ms": [], "p99_ms": [], "rps": [], "p50_ms_loaded": []}
            for rnd in range(args.rounds):
                for side in sides if rnd % 2 == 0 else sides[::-1]:
                    lat = latency_ms(side, args.requests, args.semantic)
                    res = results[side.name]
                    res["p50_ms"].append(round(pct(lat, 50), 3))
                    res["p99_ms"].append(round(pct(lat, 99), 3))
                    if has_wrk:
                        rps, loaded = throughput(side, args.seconds, script)
                        res["rps"].append(round(rps, 1))
                        res["p50_ms_loaded"].append(round(loaded, 2))
                    say(f"round {rnd + 1} {side.name}: p50 {res['p50_ms'][-1]} ms, "
                        f"{res['rps'][-1] if has_wrk else '-'} hits/s")  # fmt: skip
    finally:
        for side in sides:
            if side.proc.poll() is None:
                os.killpg(side.proc.pid, signal.SIGTERM)
                side.proc.wait(30)
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    med = {name: {k: statistics.median(v) for k, v in res.items() if v} for name, res in results.items()}
    ratios = {k: round(med["this"][k] / med["base"][k], 2) for k in med["this"] if med["base"].get(k)}
    targets = ({"semantic_hit_p50_ms": "<= 5", "semantic_hits_per_s": ">= 300"} if args.semantic
               else {"exact_hit_p50_ms": "<= 2", "exact_hits_per_s": ">= 1500"})  # fmt: skip
    kind = "semantic" if args.semantic else "exact"
    payload = {"base": args.base, "this_config": args.this_config, "kind": kind, "rounds": args.rounds,
               "seconds": args.seconds,
               "requests_per_latency_round": args.requests, "runs": results, "median": med,
               "this_over_base": ratios, "targets": targets}  # fmt: skip
    save(args.out or ("hit_path_semantic" if args.semantic else "hit_path"), payload)
    say(f"median: {med}; this/base: {ratios}")


if __name__ == "__main__":
    main()
