"""Prefix reuse of multi-turn chats through the gateway, canonicalization on vs off.

Real clients break the backend's prefix cache twice per turn: a volatile header (clock time,
request id) at the top of the system prompt, and assistant replies sent back re-formatted
(stripped, blank lines collapsed, CRLF, trailing spaces). This replays ShareGPT conversations
with real community system prompts that way, through two gateways (response cache off, so every
request reaches the backend) in front of one real backend, and compares the backend's
cached_tokens with the ideal: everything the previous turn left in the KV cache.

One backend serves both modes in turn; each mode sends its own ``cache_salt`` so its block hashes
cannot match the other's, and the two replays get byte-identical client input (same prompts,
headers, turns). The ideal and the diagnosis use the token ids the engine itself saw (a finish
listener), so no client-side re-tokenization guess enters the numbers. float32, not bf16: this
CPU has avx512_bf16 but no AMX, and bf16 measured ~1.5x slower here.

    .venv/bin/python -m bench.prefix_reuse  [--conversations 12] [--turns 4]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import dataclasses
import json
import random
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from bench.common import RESULTS, SHARED_DATA, save, say

MODEL = "SmolLM2-135M-Instruct"
MODES = ("on", "off")
HEADER = "Current date and time: {ts}. Request id: {rid}.\n\n"


def load_conversations(n: int, turns: int, max_user_chars: int) -> list[tuple[str, list[str]]]:
    """(system prompt, human turns) pairs, in file order so every run replays the same ones. System
    prompts of 1,200-2,400 characters (the long half, where reuse matters) and mostly-ASCII chats
    with user turns cut at a word, so the last turn stays under ~1,500 tokens."""
    csv.field_size_limit(sys.maxsize)
    with open(SHARED_DATA / "system_prompts.csv", newline="") as f:
        prompts = [r["prompt"] for r in csv.DictReader(f) if 1200 <= len(r["prompt"]) <= 2400]
    chats: list[list[str]] = []
    with open(SHARED_DATA / "sharegpt_dev.jsonl") as f:
        for line in f:
            conv = json.loads(line)["conversations"]
            human = [m["value"].strip() for m in conv if m["from"] == "human"][:turns]
            text = "".join(human)
            if conv and conv[0]["from"] == "human" and len(human) == turns and all(human):
                if sum(c.isascii() for c in text) >= 0.95 * len(text):
                    chats.append([h if len(h) <= max_user_chars else cut(h, max_user_chars) for h in human])
            if len(chats) == n:
                break
    return list(zip(prompts, chats, strict=False))


def cut(text: str, limit: int) -> str:
    return text[:limit].rsplit(" ", 1)[0] + " ..."


STYLES = ("strip+collapse", "crlf+trailing", "all")


def reformat(text: str, style: str) -> str:
    """What chat UIs send back: the rendered text re-serialized, not the bytes we returned."""
    if style in ("strip+collapse", "all"):
        text = re.sub(r"\n\s*\n", "\n", text.strip())
    if style in ("crlf+trailing", "all"):
        text = "\r\n".join(line + "  " for line in text.split("\n"))
    return text


def header(conv: int, turn: int, rng: random.Random) -> str:
    ts = datetime(2026, 11, 22, 10, 3, 17, tzinfo=UTC) + timedelta(minutes=10 * conv, seconds=47 * turn)
    rid = uuid.UUID(int=rng.getrandbits(128), version=4)
    return HEADER.format(ts=ts.strftime("%Y-%m-%dT%H:%M:%SZ"), rid=rid)


def lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@contextlib.contextmanager
def backend(args: argparse.Namespace, captured: dict) -> Iterator[tuple[str, Any]]:
    """The real engine over HTTP; a finish listener keeps the exact token ids it saw per request."""
    from backend.async_engine import AsyncEngine
    from backend.config import load_engine_config
    from backend.engine import LLMEngine
    from backend.server import build_app
    from tests.servers import serve_in_thread

    cfg = load_engine_config(
        None, device="cpu", dtype=args.dtype, kv_cache_tokens=args.kv_tokens, max_num_seqs=args.concurrency
    )
    llm = LLMEngine(cfg)
    engine = AsyncEngine(llm)
    engine.add_finish_listener(
        lambda o: captured.__setitem__(o.request_id, (list(o.prompt_token_ids), list(o.outputs[0].token_ids)))
    )
    try:
        with serve_in_thread(build_app(engine, MODEL, 1 << 22)) as url:
            yield f"{url}/v1", llm
    finally:
        engine.shutdown()


@contextlib.contextmanager
def gateway(backend_url: str, canonical: bool) -> Iterator[str]:
    """A gateway on its own data dir with the response cache off: every turn reaches the backend."""
    from gateway.app import build_app
    from gateway.config import load_settings
    from gateway.serve import started_gateway
    from tests.servers import serve_in_thread

    with tempfile.TemporaryDirectory(prefix="cachegw-prefix-") as tmp:
        s = load_settings(None, data_dir=tmp, backends=(backend_url,))
        s = s.model_copy(
            update={
                "cache": s.cache.model_copy(update={"enabled": False}),
                "canonicalize": dataclasses.replace(s.canonicalize, enabled=canonical),
            }
        )
        with serve_in_thread(build_app(lambda: started_gateway(s, progress=False)), lifespan="on") as url:
            yield url


def replay(
    url: str, mode: str, i: int, system: str, users: list[str], args: argparse.Namespace, captured: dict
) -> list[dict]:
    """One conversation, turn by turn, as a client with a volatile header and re-formatting UI."""
    rng, style = random.Random(f"{i}"), STYLES[i % len(STYLES)]
    history: list[dict] = []
    rows: list[dict] = []
    prev: list[int] | None = None
    with httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer bench-{mode}"}) as http:
        for k, user in enumerate(users, 1):
            messages = [{"role": "system", "content": header(i, k, rng) + system}, *history]
            messages.append({"role": "user", "content": user})
            body = {"model": MODEL, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0}
            r = http.post("/v1/chat/completions", json={**body, "cache_salt": f"prefix-reuse-{mode}"})
            r.raise_for_status()
            data = r.json()
            assert r.headers["x-cache"] == "bypass", r.headers["x-cache"]
            reply, usage = data["choices"][0]["message"]["content"], data["usage"]
            ids, out = captured.pop(data["id"])
            row = {"conv": i, "turn": k, "prompt": usage["prompt_tokens"], "completion": len(out)}
            row["cached"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            assert row["prompt"] == len(ids)
            if prev is not None:  # the previous turn's prompt + reply (the last token has no K/V)
                row["ideal"] = min(len(prev) - 1, len(ids) - 1) // args.block * args.block
                row["lcp"] = lcp(ids, prev)
                row["lost_at"] = row["lcp"] - rows[-1]["prompt"]  # < 0: inside the previous prompt
                row["lost_text"] = [prev[row["lcp"] :][:10], ids[row["lcp"] :][:10]]  # decoded later
            row["_reply"], row["_out"] = reply, out
            sent = reformat(reply, style)
            row["reformatted"] = sent != reply
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": sent}]
            prev = ids + out
            rows.append(row)
    return rows


def retokenizes_same(tokenizer: Any, reply: str, out: list[int]) -> bool:
    """Whether the reply's exact bytes, rendered as history, give back the generated token ids: if
    not, even a byte-perfect client loses the reply's K/V from the first re-split token on."""
    head = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode(f"<|im_start|>assistant\n{reply}<|im_end|>", add_special_tokens=False)
    return ids == head + out + ([] if out and out[-1] == end else [end])


def summarize(rows: list[dict], turns: int, block: int) -> dict:
    later = [r for r in rows if r["turn"] > 1]

    def ratios(rs: list[dict]) -> dict:
        c, p, i = (sum(r[k] for r in rs) for k in ("cached", "prompt", "ideal"))
        return {
            "cached": c,
            "prompt": p,
            "ideal": i,
            "cached/prompt": round(c / p, 4),
            "cached/ideal": round(c / i, 4),
        }

    return {
        **ratios(later),
        "per_turn": {k: ratios([r for r in later if r["turn"] == k]) for k in range(2, turns + 1)},
        "lost_inside_previous_prompt": sum(r["lost_at"] < 0 for r in later),
        "lost_in_reply": sum(r["lost_at"] >= 0 for r in later),
        "turns_after_first": len(later),
        # cached equals the whole blocks of the token prefix shared with the previous turn: nothing else
        # (eviction, other conversations) moved the numbers
        "cached_equals_shared_prefix": sum(
            r["cached"] == min(r["lcp"] // block * block, r["ideal"]) for r in later
        ),
        "mean_tokens_lost_before_reply": sum(max(0, -r["lost_at"]) for r in later) / max(1, len(later)),
        "replies_retokenize_same": f"{sum(r['reply_tokens_stable'] for r in rows)}/{len(rows)}",
    }


def plot(summary: dict, turns: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = list(range(2, turns + 1))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for mode, color in zip(MODES, ("tab:blue", "tab:red"), strict=True):
        per = summary[mode]["per_turn"]
        ax.plot(ks, [per[k]["cached/ideal"] for k in ks], "o-", color=color, label=f"canonicalize {mode}")
    ax.axhline(0.8, ls="--", color="gray", lw=1, label="target 0.8")
    ax.set(xlabel="turn", ylabel="cached / ideal tokens", ylim=(0, 1.05), xticks=ks)
    ax.set_title("Backend prefix reuse through cachegw (ShareGPT replay)", fontsize=10)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "prefix_reuse.png", dpi=120)
    say("wrote bench/results/prefix_reuse.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-user-chars", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=6, help="conversations in flight (= max_num_seqs)")
    ap.add_argument("--dtype", default="float32", help="float32: faster than bf16 on this CPU (no AMX)")
    ap.add_argument("--kv-tokens", type=int, default=98304)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    convs = load_conversations(args.conversations, args.turns, args.max_user_chars)
    say(f"{len(convs)} conversations x {args.turns} turns, canonicalization on then off")
    captured: dict = {}
    rows: dict[str, list[dict]] = {}
    with backend(args, captured) as (url, llm):
        args.block, tokenizer = llm.config.block_size, copy.deepcopy(llm.tokenizer)
        for mode in MODES:
            rows[mode] = []
            with gateway(url, mode == "on") as gw, ThreadPoolExecutor(args.concurrency) as pool:
                jobs = [
                    pool.submit(replay, gw, mode, i, s, u, args, captured) for i, (s, u) in enumerate(convs)
                ]
                for n, job in enumerate(jobs, 1):
                    rows[mode] += job.result()
                    later = [r for r in rows[mode] if r["turn"] > 1]
                    c, i = sum(r["cached"] for r in later), sum(r["ideal"] for r in later)
                    say(f"[{mode}] {n}/{len(convs)} conversations, turns > 1: cached/ideal {c / i:.3f}")
    for r in (r for m in MODES for r in rows[m]):
        r["reply_tokens_stable"] = retokenizes_same(tokenizer, r.pop("_reply"), r.pop("_out"))
        if "lost_text" in r:  # (what the cache held, what was sent) from the first differing token
            r["lost_text"] = [tokenizer.decode(t) for t in r["lost_text"]]
    summary = {m: summarize(rows[m], args.turns, args.block) for m in MODES}
    # No eviction: each mode computes at most this many new tokens, fewer than the cache holds, and
    # the LRU takes the other mode's (older) blocks first.
    needed = {m: sum(r["prompt"] - r["cached"] + r["completion"] for r in rows[m]) for m in MODES}
    assert max(needed.values()) <= args.kv_tokens, (needed, args.kv_tokens)
    print(f"\n{'turn':>5} | {'on cached/prompt':>16} {'on cached/ideal':>15} | {'off cached/prompt':>17} "
          f"{'off cached/ideal':>16}")  # fmt: skip
    for k in [*range(2, args.turns + 1), "all"]:
        on, off = (summary[m] if k == "all" else summary[m]["per_turn"][k] for m in MODES)
        print(f"{k:>5} | {on['cached/prompt']:16.3f} {on['cached/ideal']:15.3f} | "
              f"{off['cached/prompt']:17.3f} {off['cached/ideal']:16.3f}")  # fmt: skip
    holds = summary["on"]["cached/ideal"] >= 0.8
    say(f"target on >= 0.8 of ideal: {'holds' if holds else 'MISSED'} ({summary['on']['cached/ideal']:.3f})")
    config = {k: v for k, v in vars(args).items() if k != "block"}
    config |= {"model": MODEL, "block_size": args.block, "header": HEADER, "reformat_styles": STYLES}
    save(
        "prefix_reuse",
        {
            "config": config,
            "ideal": "turn k>1: previous turn's prompt + reply tokens with K/V (reply minus its last token), "
            "capped at this prompt minus 1, rounded down to whole blocks; from the token ids the engine saw",
            "target": "canonicalize on: cached/ideal >= 0.8 for turns after the first",
            "target_holds": holds,
            "summary": summary,
            "new_tokens_computed": needed,
            "runtime_s": round(time.perf_counter() - start, 1),
            "turns": rows,
        },
    )
    plot(summary, args.turns)


if __name__ == "__main__":
    main()
