"""Chaos run: the real gateway with its built-in engine, under steady load, through repeated faults.

`cachegw serve` runs as a process (free loopback ports, a temp data dir), as a user would run it.
Four threads send requests all along: two ask questions never asked before (misses, JSON and
stream), two repeat questions answered at the start (hits). Each cycle injects, in turn:

- ``engine-kill``: kill -9 of the engine process under load;
- ``engine-stop``: SIGSTOP of the engine (hung: the supervisor must notice and replace it);
- ``stream-crash``: kill -9 of the engine while long streams are relayed;
- ``gateway-kill``: kill -9 of the gateway (and its engine, as a machine or container loss would),
  then a fresh `cachegw serve` on the same data dir.

After each fault it waits for the next successful miss that started after the fault: that time is the
fault's downtime. At the end every answered new question is asked again (it must be a hit with the
same text: else an entry was lost or a wrong answer served), the gateway is stopped cleanly, and the
request log is compared with what the clients were answered.

    python -m bench.chaos [--cycles 1] [--log-commit batched|per_request]   # ~5 min per cycle, 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.chaos_load import POOL, Load, Outcome, ask, long_streams
from bench.common import ROOT, save, say
from cachegw.gateway.upstream.supervisor import port_is_free

FAULTS = ("engine-kill", "engine-stop", "stream-crash", "gateway-kill")


@dataclass
class Fault:
    kind: str
    at: float
    recovered_at: float | None = None
    hits_during: int = 0  # requests that ended between the fault and the recovery
    failed_during: dict[str, int] = field(default_factory=dict)
    streams: dict[str, int] = field(default_factory=dict)

    @property
    def downtime_s(self) -> float | None:
        return None if self.recovered_at is None else round(self.recovered_at - self.at, 2)


class Gateway:
    """`cachegw serve` as a process group (the gateway and its engine child)."""

    def __init__(self, work: Path, log_commit: str) -> None:
        self.work, self.port, self.engine_port = work, free_port(), free_port()
        self.config = work / "cachegw.toml"
        self.config.write_text(
            f'[gateway]\nrequest_log_commit = "{log_commit}"\n[backend_server]\nport = {self.engine_port}\n'
            '[engine]\ndtype = "float32"\nquantization = "none"\nkv_cache_tokens = 8192\nmax_num_seqs = 8\n'
            'compile = "off"\n'
        )
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        self.starts = 0

    def start(self, timeout: float = 240) -> None:
        self.starts += 1
        log = (self.work / f"gateway-{self.starts}.log").open("w")
        cmd = [sys.executable, "-m", "cachegw.gateway.cli", "serve", "--config", str(self.config)]
        cmd += ["--data-dir", str(self.work / "data"), "--port", str(self.port)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cachegw serve exited {self.proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("cachegw serve did not become healthy")

    def engine_pid(self) -> int | None:
        pattern = f"cachegw.gateway.cli backend .*--port {self.engine_port}"
        out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        return int(out[0]) if out else None

    def kill_9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        deadline = time.monotonic() + 30  # the ports are free again once the group is gone
        while not (port_is_free("127.0.0.1", self.port) and port_is_free("127.0.0.1", self.engine_port)):
            if time.monotonic() > deadline:
                raise RuntimeError("ports still taken after kill -9")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inject(kind: str, tag: str, gw: Gateway) -> tuple[float, list[Outcome]]:
    """Cause the fault; returns its time and, for stream-crash, the long streams it cut."""
    streams: list[Outcome] = []
    threads: list[threading.Thread] = []
    if kind == "stream-crash":
        barrier = threading.Barrier(4)
        streams, threads = long_streams(gw.url, tag, 3, barrier)
        try:
            barrier.wait(90)
        except threading.BrokenBarrierError:
            pass
    pid = gw.engine_pid()
    at = time.monotonic()
    if kind in ("engine-kill", "stream-crash") and pid:
        os.kill(pid, signal.SIGKILL)
    elif kind == "engine-stop" and pid:
        os.kill(pid, signal.SIGSTOP)
    elif kind == "gateway-kill":
        gw.kill_9()
        gw.start()
    for t in threads:
        t.join(120)
    return at, streams


def wait_recovered(load: Load, fault: Fault, timeout: float) -> None:
    """Until the first successful miss sent after the fault; then what clients saw meanwhile."""
    while time.monotonic() < fault.at + timeout and fault.recovered_at is None:
        done = [o.end for o in load.since(fault.at) if o.ok and o.x_cache == "miss"]
        fault.recovered_at = min(done) if done else None
        time.sleep(0.2)
    until = fault.recovered_at or time.monotonic()
    with load.lock:
        window = [o for o in load.outcomes if fault.at <= o.end <= until]
    fault.hits_during = sum(o.ok and o.x_cache.endswith("hit") for o in window)
    fault.failed_during = dict(Counter(o.failure for o in window if not o.ok))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=1, help="rounds of the four faults")
    p.add_argument("--max-seconds", type=float, default=300, help="no new fault after this")
    p.add_argument("--log-commit", choices=["batched", "per_request"], default="batched")
    p.add_argument("--settle", type=float, default=4.0, help="seconds of plain load between faults")
    p.add_argument("--out", default="chaos")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cachegw-chaos-") as tmp:
        gw = Gateway(Path(tmp), args.log_commit)
        say(f"starting cachegw serve on :{gw.port} (engine :{gw.engine_port}) in {tmp}")
        gw.start()
        say(f"gateway up in {time.monotonic() - t0:.1f} s; warming the {len(POOL)} repeated questions")
        first: dict[str, str] = {}
        with httpx.Client(timeout=120) as c:
            for q in POOL:
                first[q] = ask(c, gw.url, q, stream=False).text
        load = Load(gw.url)
        for t in load.threads:
            t.start()
        time.sleep(args.settle)
        faults: list[Fault] = []
        broken_streams: list[Outcome] = []
        for cycle in range(args.cycles):
            for kind in FAULTS:
                if time.monotonic() - t0 > args.max_seconds:
                    break
                at, streams = inject(kind, f"cycle {cycle}", gw)
                fault = Fault(kind, at, streams=dict(Counter(s.stream_end for s in streams)))
                broken_streams += [s for s in streams if s.stream_end != "done"]
                wait_recovered(load, fault, timeout=150)
                faults.append(fault)
                say(
                    f"cycle {cycle + 1} {kind}: downtime {fault.downtime_s} s, "
                    f"{fault.hits_during} hits served, {fault.failed_during} failed meanwhile "
                    f"{fault.streams or ''}"
                )
                time.sleep(args.settle)
        load.stop.set()
        for t in load.threads:
            t.join(120)
        report = verify(gw, load, first)
        gw.stop()
        report |= log_check(Path(tmp) / "data" / "cachegw.db", load.outcomes + broken_streams, faults)
        report["cut_streams"] = len(broken_streams)
        report["cut_streams_stored"] = stored(Path(tmp) / "data" / "cachegw.db", broken_streams)
        report["supervisor_log"] = supervisor_lines(Path(tmp))
    report |= {
        "command": "python -m bench.chaos " + " ".join(argv if argv is not None else sys.argv[1:]),
        "log_commit": args.log_commit,
        "wall_s": round(time.monotonic() - t0, 1),
        "faults": [{**asdict(f), "downtime_s": f.downtime_s} for f in faults],
    }
    for f in report["faults"]:
        f.pop("at"), f.pop("recovered_at")
    save(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "faults"}, indent=2))
    return 0


def verify(gw: Gateway, load: Load, first: dict[str, str]) -> dict:
    """Wrong answers among the hits, and answered new questions that no longer hit (lost entries)."""
    answered: dict[str, str] = {}
    wrong = 0
    for o in load.outcomes:
        if o.ok and o.question in first and o.x_cache.endswith("hit") and o.text != first[o.question]:
            wrong += 1
        if o.ok and o.x_cache == "miss" and o.question not in first:
            answered.setdefault(o.question, o.text)
    lost, wrong_after = 0, 0
    with httpx.Client(timeout=120) as c:
        for q, text in answered.items():
            again = ask(c, gw.url, q, stream=False)
            lost += not again.x_cache.endswith("hit")
            wrong_after += again.x_cache.endswith("hit") and again.text != text
    tried = len(load.outcomes)
    failed = Counter(o.failure for o in load.outcomes if not o.ok)
    return {
        "requests_tried": tried,
        "requests_ok": sum(o.ok for o in load.outcomes),
        "failed_by_status": dict(failed),
        "hits_served": sum(o.ok and o.x_cache.endswith("hit") for o in load.outcomes),
        "wrong_answers": wrong + wrong_after,
        "answered_misses_checked": len(answered),
        "lost_entries": lost,
    }


def supervisor_lines(work: Path) -> list[str]:
    """What the supervisor said (restart causes and delays, engine ready): where downtime went."""
    keep = ("built-in backend", "restart")
    lines = [ln for log in sorted(work.glob("gateway-*.log")) for ln in log.read_text().splitlines()]
    return [ln[11:110] for ln in lines if any(k in ln for k in keep)]


def stored(db: Path, streams: list[Outcome]) -> int:
    """Cut streams whose question has a cache entry: each one would serve a truncated answer."""
    with sqlite3.connect(db) as conn:
        return sum(
            conn.execute("SELECT count(*) FROM cache_entries WHERE query_text = ?", (s.question,)).fetchone()[
                0
            ]
            for s in streams
        )


def log_check(db: Path, outcomes: list[Outcome], faults: list[Fault]) -> dict:
    """Request-log rows missing for requests the clients got an answer to, by the nearest fault."""
    with sqlite3.connect(db) as conn:
        rows = {r[0] for r in conn.execute("SELECT id FROM requests")}
    answered = [o for o in outcomes if o.request_id and o.status == 200 and o.stream_end in ("", "done")]
    missing = [o for o in answered if o.request_id not in rows]
    by_fault: Counter[str] = Counter()
    for o in missing:
        # the nearest fault: a client may finish reading an answer just after a kill began
        by_fault[min(faults, key=lambda f: abs(f.at - o.end)).kind if faults else "none"] += 1
    return {
        "log_rows_expected": len(answered),
        "log_rows_lost": len(missing),
        "log_rows_lost_near": dict(by_fault),
    }


if __name__ == "__main__":
    sys.exit(main())
