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

With ``--scenario unlisted`` the system prompts carry per-request values in forms no listed pattern
covers (``bench/volatile_forms.py``: a design set and a held-out set), conversations share a few
templates as users of one app do, and the modes are canonicalization with volatile spans learned
from traffic ("learn") against the listed patterns alone ("listed"). ``--warmup`` single-turn
requests per template go first, as other users of the app would have sent (not measured).

    .venv/bin/python -m bench.prefix_reuse  [--conversations 12] [--turns 4] [--scenario unlisted]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import json
import random
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from bench.common import RESULTS, SHARED_DATA, save, say

MODEL = "SmolLM2-135M-Instruct"
MODES = ("on", "off")
UNLISTED_MODES = ("learn", "listed")
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
    from cachegw.backend.config import load_engine_config
    from cachegw.backend.core.async_engine import AsyncEngine
    from cachegw.backend.core.engine import LLMEngine
    from cachegw.backend.entrypoints.server import build_app
    from testkit.servers import serve_in_thread

    cfg = load_engine_config(
        None,
        device="cpu",
        dtype=args.dtype,
        quantization="none",
        kv_cache_tokens=args.kv_tokens,
        max_num_seqs=args.concurrency,
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
def gateway(backend_url: str, canonical: bool, learn: bool = True) -> Iterator[str]:
    """A gateway on its own data dir with the response cache off: every turn reaches the backend."""
    from cachegw.gateway.api.app import build_app
    from cachegw.gateway.compose import started_gateway
    from cachegw.gateway.config import load_settings
    from testkit.servers import serve_in_thread

    with tempfile.TemporaryDirectory(prefix="cachegw-prefix-") as tmp:
        s = load_settings(None, data_dir=tmp, backends=(backend_url,))
        s = s.model_copy(
            update={
                "cache": s.cache.model_copy(update={"enabled": False}),
                "canonicalize": s.canonicalize.model_copy(
                    update={
                        "enabled": canonical,
                        "learn": s.canonicalize.learn.model_copy(update={"enabled": learn}),
                    }
                ),
            }
        )
        with serve_in_thread(build_app(lambda: started_gateway(s, progress=False)), lifespan="on") as url:
            yield url


def replay(
    url: str,
    mode: str,
    i: int,
    system_at: Callable[[int], str],
    users: list[str],
    args: argparse.Namespace,
    captured: dict,
) -> list[dict]:
    """One conversation, turn by turn, as a client with volatile values (``system_at(turn)``) and a
    re-formatting UI."""
    style = STYLES[i % len(STYLES)]
    history: list[dict] = []
    rows: list[dict] = []
    prev: list[int] | None = None
    with httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer bench-{mode}"}) as http:
        for k, user in enumerate(users, 1):
            messages = [{"role": "system", "content": system_at(k)}, *history]
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


def plot(summary: dict, turns: int, modes: tuple[str, ...], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = list(range(2, turns + 1))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for mode, color in zip(modes, ("tab:blue", "tab:red"), strict=True):
        per = summary[mode]["per_turn"]
        ratios = [per[str(k)]["cached/ideal"] for k in ks]
        ax.plot(ks, ratios, "o-", color=color, label=f"canonicalize {mode}")
    ax.axhline(0.8, ls="--", color="gray", lw=1, label="target 0.8")
    ax.set(xlabel="turn", ylabel="cached / ideal tokens", ylim=(0, 1.05), xticks=ks)
    ax.set_title("Backend prefix reuse through cachegw (ShareGPT replay)", fontsize=10)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)
    say(f"wrote bench/results/{name}.png")


def systems(args: argparse.Namespace, convs: list) -> tuple[list[Callable[[int], str]], list[str], dict]:
    """Per conversation: its system prompt at turn k, and the form set it uses ("" for listed)."""
    if args.scenario == "listed":

        def listed(i: int, system: str) -> Callable[[int], str]:
            rng = random.Random(f"{i}")  # one draw per turn, in turn order
            return lambda k: header(i, k, rng) + system

        return [listed(i, s) for i, (s, _) in enumerate(convs)], [""] * len(convs), {"header": HEADER}
    from bench.volatile_forms import forms_for, template

    draws, described = [], {}
    for t in range(args.templates):
        which = "design" if t < (args.templates + 1) // 2 else "held_out"
        names, forms = forms_for(which, t if which == "design" else t - (args.templates + 1) // 2)
        draws.append((which, template(convs[t][0], forms)))
        described[f"template {t}"] = {"set": which, "forms": names}
    at = [lambda k, i=i: draws[i % len(draws)][1](random.Random(f"{i}:{k}")) for i in range(len(convs))]
    return at, [draws[i % len(draws)][0] for i in range(len(convs))], {"templates": described, "draws": draws}


def warm_up(url: str, mode: str, draws: list, args: argparse.Namespace, captured: dict) -> None:
    """Other users of each app: single-turn requests that let the gateway see the template."""
    with httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer bench-{mode}"}) as http:
        for t, (_, draw) in enumerate(draws):
            for j in range(args.warmup):
                system = draw(random.Random(f"warm{t}:{j}"))
                body = {"model": MODEL, "max_tokens": 4, "temperature": 0}
                body["cache_salt"] = f"prefix-reuse-{mode}"
                messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello."}]
                r = http.post("/v1/chat/completions", json={**body, "messages": messages})
                r.raise_for_status()
                captured.pop(r.json()["id"], None)


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
    ap.add_argument("--scenario", choices=("listed", "unlisted"), default="listed")
    ap.add_argument("--templates", type=int, default=4, help="unlisted: apps (half design, half held out)")
    ap.add_argument("--warmup", type=int, default=3, help="unlisted: single-turn requests per template")
    ap.add_argument("--mode", default="both", help="one mode only: joins an earlier run's other mode")
    ap.add_argument("--tag", default="", help="results go to bench/results/<name>_<tag>.json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    modes = MODES if args.scenario == "listed" else UNLISTED_MODES
    name = "prefix_reuse" if args.scenario == "listed" else "prefix_reuse_unlisted"
    name += f"_{args.tag}" if args.tag else ""
    convs = load_conversations(args.conversations, args.turns, args.max_user_chars)
    at, sets, described = systems(args, convs)
    draws = described.pop("draws", [])
    ran = modes if args.mode == "both" else (args.mode,)
    if not set(ran) <= set(modes):
        ap.error(f"--mode: one of {modes} or both")
    say(f"{len(convs)} conversations x {args.turns} turns, modes {ran}")
    captured: dict = {}
    rows: dict[str, list[dict]] = {}
    with backend(args, captured) as (url, llm):
        args.block, tokenizer = llm.config.block_size, copy.deepcopy(llm.tokenizer)
        for mode in ran:
            rows[mode] = []
            learn = mode != "listed"
            with gateway(url, mode != "off", learn) as gw, ThreadPoolExecutor(args.concurrency) as pool:
                warm_up(gw, mode, draws, args, captured)
                run = lambda i, users, gw=gw, mode=mode: replay(gw, mode, i, at[i], users, args, captured)
                jobs = [pool.submit(run, i, users) for i, (_, users) in enumerate(convs)]
                for n, job in enumerate(jobs, 1):
                    rows[mode] += [{**r, "set": sets[n - 1]} if sets[n - 1] else r for r in job.result()]
                    later = [r for r in rows[mode] if r["turn"] > 1]
                    c, i = sum(r["cached"] for r in later), sum(r["ideal"] for r in later)
                    say(f"[{mode}] {n}/{len(convs)} conversations, turns > 1: cached/ideal {c / i:.3f}")
    for r in (r for m in ran for r in rows[m]):
        r["reply_tokens_stable"] = retokenizes_same(tokenizer, r.pop("_reply"), r.pop("_out"))
        if "lost_text" in r:  # (what the cache held, what was sent) from the first differing token
            r["lost_text"] = [tokenizer.decode(t) for t in r["lost_text"]]
    summary = {m: summarize(rows[m], args.turns, args.block) for m in ran}
    for m in ran if args.scenario == "unlisted" else ():
        summary[m]["by_set"] = {
            which: summarize([r for r in rows[m] if r.get("set") == which], args.turns, args.block)
            for which in ("design", "held_out")
        }
    # No eviction: each mode computes at most this many new tokens, fewer than the cache holds, and
    # the LRU takes the other mode's (older) blocks first.
    needed = {m: sum(r["prompt"] - r["cached"] + r["completion"] for r in rows[m]) for m in ran}
    assert max(needed.values()) <= args.kv_tokens, (needed, args.kv_tokens)
    config = {k: v for k, v in vars(args).items() if k not in ("block", "mode", "tag")}
    config |= {"model": MODEL, "block_size": args.block, "reformat_styles": STYLES, **described}
    runs = [{"modes": list(ran), "runtime_s": round(time.perf_counter() - start, 1)}]
    path = RESULTS / f"{name}.json"
    earlier = json.loads(path.read_text()) if args.mode != "both" and path.exists() else None
    # the other mode, run on its own with the same settings
    if earlier and earlier["config"] == json.loads(json.dumps(config)):
        for m in (m for m in modes if m not in ran and m in earlier["summary"]):
            summary[m], rows[m] = earlier["summary"][m], earlier["turns"][m]
            needed[m] = earlier["new_tokens_computed"][m]
        runs = [r for r in earlier.get("runs", []) if not set(r["modes"]) & set(ran)] + runs
    if set(summary) != set(modes):
        say(f"only {sorted(summary)}: run the other mode with the same settings to compare")
        modes = tuple(summary)
    summary = json.loads(json.dumps(summary))  # as saved: per_turn keys are strings
    a, b = (*modes, modes[0])[:2]
    print(f"\n{'turn':>9} | {a + ' cached/prompt':>20} {a + ' cached/ideal':>19} | "
          f"{b + ' cached/prompt':>20} {b + ' cached/ideal':>19}")  # fmt: skip
    keys: list[Any] = [*range(2, args.turns + 1), "all"]
    keys += ["design", "held_out"] if args.scenario == "unlisted" else []
    for k in keys:
        pick = lambda m, k=k: summary[m]["by_set" if isinstance(k, str) else "per_turn"][str(k)]
        one, two = (summary[m] if k == "all" else pick(m) for m in (a, b))
        print(f"{k:>9} | {one['cached/prompt']:20.3f} {one['cached/ideal']:19.3f} | "
              f"{two['cached/prompt']:20.3f} {two['cached/ideal']:19.3f}")  # fmt: skip
    holds = summary[a]["cached/ideal"] >= 0.8
    say(f"target {a} >= 0.8 of ideal: {'holds' if holds else 'MISSED'} ({summary[a]['cached/ideal']:.3f})")
    save(
        name,
        {
            "config": config,
            "ideal": "turn k>1: previous turn's prompt + reply tokens with K/V (reply minus its last token), "
            "capped at this prompt minus 1, rounded down to whole blocks; from the token ids the engine saw",
            "target": f"canonicalize {a}: cached/ideal >= 0.8 for turns after the first",
            "target_holds": holds,
            "summary": summary,
            "new_tokens_computed": needed,
            "runs": runs,
            "turns": rows,
        },
    )
    if len(modes) == 2:
        plot(summary, args.turns, modes, name)


if __name__ == "__main__":
    main()
