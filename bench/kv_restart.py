"""TTFT of a ~5,000-token prompt: cold, after a SIGTERM restart of `cachegw backend` (the pool written to the
disk tier at shutdown), and on a second engine that never saw it (served from the Redis tier).

Two real `cachegw backend` processes on the embedded SmolLM2 (compile off: TTFT is the prefill): A with
a disk tier and Redis, B with Redis alone; a throwaway `redis-server` on a free port. Each repeat draws a
new prompt (random token ids), then in turn: A answers it cold; A is stopped with SIGTERM (the time to
exit and the blocks written are recorded) and started again; A answers it again (from disk), and again
(from its pool); B answers it (from Redis). TTFT is the time to the first streamed token, ``max_tokens``
4, greedy; the greedy text of every answer is compared with the cold one. With ``--write-behind`` A
copies each block to disk and Redis as it is filled, and its cold TTFT is measured both ways
(alternating by repeat) to show what that costs.

    flock /tmp/cachegw-bench.lock .venv/bin/python -m bench.kv_restart [--repeats 2] [--tokens 5000]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import save, say
from testkit.backend_process import BackendProcess, start_backend
from testkit.servers import free_port, redis_server


def ttft(backend: BackendProcess, prompt: list[int]) -> tuple[float, str, int]:
    """Seconds to the first streamed token, the whole greedy text, and the cached prompt tokens."""
    body = {
        "model": backend.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    start, first, text, cached = time.perf_counter(), None, "", -1
    with httpx.stream("POST", backend.url + "/v1/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                if first is None:
                    first = time.perf_counter() - start
                text += choice.get("text") or ""
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert first is not None, "no token streamed"
    return first, text, cached


def config(folder: Path, name: str, redis_url: str, disk: bool, write_behind: bool) -> Path:
    lines = [
        'compile = "off"',
        f'kv_offload_url = "{redis_url}"',
        f"kv_write_behind = {str(write_behind).lower()}",
    ]
    if disk:
        lines.append(f'kv_offload_dir = "{folder / "kv"}"')
    path = folder / f"{name}.toml"
    path.write_text("[engine]\n" + "\n".join(lines) + "\n")
    return path


def blocks_on_disk(folder: Path) -> int:
    return sum(1 for _ in (folder / "kv").rglob("*.kv"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=5000)
    ap.add_argument("--write-behind", action="store_true", help="alternate A's kv_write_behind by repeat")
    ap.add_argument("--model", default="", help="a model other than the embedded SmolLM2")
    args = ap.parse_args()
    rng = random.Random(5000)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kv-restart-") as tmp, redis_server("2gb") as redis_url:
        folder = Path(tmp)
        log = folder / "backend.log"
        model = ("--model", args.model) if args.model else ()
        b = start_backend(
            config(folder, "b", redis_url, disk=False, write_behind=False), log, free_port(), *model
        )
        try:
            for rep in range(args.repeats):
                behind = args.write_behind and rep % 2 == 1
                a_cfg = config(folder, f"a{rep}", redis_url, disk=True, write_behind=behind)
                prompt = [rng.randrange(100, 49000) for _ in range(args.tokens)]
                a = start_backend(a_cfg, log, free_port(), *model)
                cold, cold_text, _ = ttft(a, prompt)
                say(f"repeat {rep}: cold {cold:.2f} s (write-behind {'on' if behind else 'off'})")
                t0 = time.perf_counter()
                status = a.stop(signal.SIGTERM)
                stop_s, written = time.perf_counter() - t0, blocks_on_disk(folder)
                t0 = time.perf_counter()
                a = start_backend(a_cfg, log, free_port(), *model)
                start_s = time.perf_counter() - t0
                restart, restart_text, restart_cached = ttft(a, prompt)
                pool, pool_text, _ = ttft(a, prompt)
                a.stop()
                redis, redis_text, redis_cached = ttft(b, prompt)
                row = {
                    "repeat": rep, "write_behind": behind, "cold_ttft_s": round(cold, 3),
                    "restart_ttft_s": round(restart, 3), "restart_cached_tokens": restart_cached,
                    "pool_ttft_s": round(pool, 3), "redis_ttft_s": round(redis, 3),
                    "redis_cached_tokens": redis_cached, "sigterm_exit_status": status,
                    "sigterm_to_exit_s": round(stop_s, 2), "blocks_on_disk": written,
                    "start_s": round(start_s, 1),
                    "same_text": restart_text == cold_text == pool_text == redis_text,
                }  # fmt: skip
                say(json.dumps(row))
                rows.append(row)
        finally:
            b.stop()

    def mean(key: str, rows: list[dict] = rows) -> float:
        return sum(r[key] for r in rows) / len(rows)

    off = [r for r in rows if not r["write_behind"]]
    summary = {
        "prompt_tokens": args.tokens,
        "cold_ttft_s": round(mean("cold_ttft_s", off), 3),
        "restart_ttft_s": round(mean("restart_ttft_s"), 3),
        "redis_ttft_s": round(mean("redis_ttft_s"), 3),
        "pool_ttft_s": round(mean("pool_ttft_s"), 3),
        "cold_over_restart": round(mean("cold_ttft_s", off) / mean("restart_ttft_s"), 1),
        "cold_over_redis": round(mean("cold_ttft_s", off) / mean("redis_ttft_s"), 1),
        "min_cached_share": round(
            min(min(r["restart_cached_tokens"], r["redis_cached_tokens"]) for r in rows) / args.tokens, 3
        ),
        "all_same_text": all(r["same_text"] for r in rows),
    }
    if args.write_behind and len(off) < len(rows):
        summary["cold_ttft_write_behind_s"] = round(
            mean("cold_ttft_s", [r for r in rows if r["write_behind"]]), 3
        )
    say(json.dumps(summary))
    save("kv_restart", {"summary": summary, "rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
