"""Speculative decoding with n-gram (prompt-lookup) drafts vs plain decoding, batch 1, one engine.

Prompts come from ShareGPT conversations (``../shared/data/sharegpt_dev.jsonl``): input-grounded
tasks built from first turns that carry a long text (summarize it; rewrite the code it contains;
quote one of its sentences, named by how it begins) and open chat (short first turns as asked).
Each prompt runs plain and with drafts back to back in one process, ``--repeats`` pairs, the order
alternating, greedy, so the outputs must be identical (checked); decode times are each mode's
median, and the figures are ratios of them (the machine's load moves within seconds). Then end
to end through the gateway: a question stored, a paraphrase its number guard
refuses (a near miss) asked with the stored answer as the engine's draft, and with
``Cache-Control: no-store`` (no lookup, so no draft), alternating; the engine speculates in both.

    .venv/bin/python -m bench.spec_decode [--per-task 2] [--repeats 3] [--max-tokens 48] [--pairs 3]
        [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import textwrap
import time
from dataclasses import dataclass

from bench.common import RESULTS, SHARED_DATA, save, say

TASKS = ("summarize", "edit code", "answer from a document", "open chat")
DOC_CHARS = (800, 2200)  # a first turn carrying a text: long enough to ground, short to prefill


@dataclass
class Case:
    task: str
    prompt: str


def _is_code(text: str) -> bool:
    return "```" in text or bool(
        re.search(r"^\s*(def |class |function |import |#include|public )", text, re.M)
    )


def cases(path: str, per_task: int) -> list[Case]:
    """``per_task`` prompts per task, from the first turns in file order (deterministic)."""
    picked: dict[str, list[Case]] = {t: [] for t in TASKS}
    with open(path) as f:
        for line in f:
            turns = json.loads(line).get("conversations") or []
            if not turns or turns[0].get("from") != "human":
                continue
            text = turns[0]["value"].strip()
            if DOC_CHARS[0] <= len(text) <= DOC_CHARS[1]:
                if _is_code(text):
                    task, prompt = (
                        "edit code",
                        f"{text}\n\nRewrite the code above with clearer names. Output the code.",
                    )
                elif len(picked["summarize"]) <= len(picked["answer from a document"]):
                    task, prompt = "summarize", f"{text}\n\nSummarize the text above."
                else:
                    first = re.split(r"(?<=[.!?])\s", text)[0][:120]
                    task = "answer from a document"
                    prompt = f"{text}\n\nQuote the sentence of the text above that begins with: {first!r}"
            elif 20 <= len(text) <= 200 and not _is_code(text):
                task, prompt = "open chat", text
            else:
                continue
            if len(picked[task]) < per_task:
                picked[task].append(Case(task, prompt))
            if all(len(v) >= per_task for v in picked.values()):
                break
    return [c for t in TASKS for c in picked[t]]


def run_one(engine, rid: str, ids: list[int], params) -> tuple[list[int], float, float, int, int]:
    """(output ids, seconds to the first token, seconds after it, drafted, accepted)."""
    t0 = time.perf_counter()
    seq = engine.add_request(rid, ids, params)
    first = 0.0
    while engine.has_unfinished_requests():
        engine.step()
        if not first and seq.num_output_tokens:
            first = time.perf_counter()
    end = time.perf_counter()
    drafted = seq.spec.drafted if seq.spec else 0
    accepted = seq.spec.accepted if seq.spec else 0
    return seq.output_token_ids, first - t0, end - first, drafted, accepted


def engine_part(args: argparse.Namespace) -> list[dict]:
    from cachegw.backend import LLM, SamplingParams
    from cachegw.backend.core.speculative import Speculator

    llm = LLM(
        compile="off", quantization="none", kv_cache_tokens=16384, max_num_seqs=4, enable_prefix_caching=False
    )
    engine = llm.engine
    spec = Speculator(args.k, args.ngram_min, args.ngram_max)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows = []
    for i, case in enumerate(cases(str(args.data / "sharegpt_dev.jsonl"), args.per_task)):
        ids = llm.chat_prompt_ids([{"role": "user", "content": case.prompt}])
        outs: dict[str, list[int]] = {}
        secs: dict[str, list[float]] = {"off": [], "ngram": []}
        drafted = accepted = 0
        identical = True
        for r in range(args.repeats):  # off/ngram pairs back to back, the order alternating
            for mode in ("off", "ngram") if (i + r) % 2 == 0 else ("ngram", "off"):
                engine.speculator = spec if mode == "ngram" else None
                out, _, dec, d, a = run_one(engine, f"{mode}-{i}-{r}", ids, params)
                identical &= outs.setdefault(mode, out) == out
                secs[mode].append(dec)
                drafted, accepted = (d, a) if mode == "ngram" else (drafted, accepted)
        engine.speculator = None
        out_off, out_on = outs["off"], outs["ngram"]
        dec_off, dec_on = statistics.median(secs["off"]), statistics.median(secs["ngram"])
        n = len(out_off) - 1
        row = {
            "task": case.task,
            "prompt_tokens": len(ids),
            "tokens": len(out_off),
            "identical": identical and out_off == out_on,
            "decode_s_off": round(dec_off, 3),
            "decode_s_ngram": round(dec_on, 3),
            "tok_s_off": round(n / dec_off, 2) if n > 0 else None,
            "tok_s_ngram": round(n / dec_on, 2) if n > 0 else None,
            "speedup": round(dec_off / dec_on, 3) if dec_on > 0 else None,
            "drafted": drafted,
            "accepted": accepted,
        }
        rows.append(row)
        say(f"{case.task:24s} {row['tokens']:3d} tokens  x{row['speedup']}  accepted {accepted}/{drafted}")
    del llm, engine
    return rows


def batch_part(args: argparse.Namespace) -> list[dict]:
    """Several summaries at once (``--batch-sizes``): does speculation still pay once a batch
    already reads each weight once for many tokens? Wall time of the whole batch, off vs ngram,
    the best of ``--repeats`` interleaved pairs, every sequence allowed to speculate."""
    from cachegw.backend import LLM, SamplingParams
    from cachegw.backend.core.speculative import Speculator

    llm = LLM(
        compile="off",
        quantization="none",
        kv_cache_tokens=16384,
        max_num_seqs=16,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    engine.scheduler.speculative_max_seqs = 64
    grounded = [c for c in cases(str(args.data / "sharegpt_dev.jsonl"), 8) if c.task == "summarize"]
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": c.prompt}]) for c in grounded]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    spec = Speculator(args.k, args.ngram_min, args.ngram_max)
    rows = []
    for size in args.batch_sizes:
        secs: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.repeats):
            for on in (False, True) if r % 2 == 0 else (True, False):
                engine.speculator = spec if on else None
                t = time.perf_counter()
                llm.generate(prompts[:size], params)
                secs[on].append(time.perf_counter() - t)
        engine.speculator = None
        off, on_s = min(secs[False]), min(secs[True])
        rows.append(
            {
                "batch": size,
                "seconds_off": round(off, 3),
                "seconds_ngram": round(on_s, 3),
                "speedup": round(off / on_s, 3),
            }
        )
        say(f"batch {size}: x{rows[-1]['speedup']}")
    return rows


PAIRS = [  # stored question, then a paraphrase its number guard refuses: the same answer but one figure
    (
        "Explain in three sentences what a hash table is, for a class of 20 students.",
        "Explain in three sentences what a hash table is, for a class of 30 students.",
    ),
    (
        "List 5 tips for writing clean Python code.",
        "List 6 tips for writing clean Python code.",
    ),
    (
        "Write a short story about a cat in 80 words.",
        "Write a short story about a cat in 90 words.",
    ),
]


def gateway_part(args: argparse.Namespace) -> list[dict]:
    """One gateway in front of an engine with drafts on. Per pair: the first question stored, then its
    paraphrase asked as is (a refused near miss: the stored answer goes as the draft) and with
    ``Cache-Control: no-store`` (no lookup, so no draft), the order alternating."""
    import tempfile

    import openai

    from cachegw.backend.config import load_engine_config
    from cachegw.backend.core.async_engine import AsyncEngine
    from cachegw.backend.core.engine import LLMEngine
    from cachegw.backend.entrypoints.server import build_app as backend_app
    from cachegw.gateway.api.app import build_app
    from cachegw.gateway.compose import started_gateway
    from cachegw.gateway.config import load_settings
    from testkit.servers import serve_in_thread

    cfg = load_engine_config(
        None, quantization="none", kv_cache_tokens=8192, max_num_seqs=4, speculative="ngram"
    )
    engine = AsyncEngine(LLMEngine(cfg))
    rows = []
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(backend_app(engine, "m", 1 << 20)) as b:
        s = load_settings(None, data_dir=tmp, backends=({"url": f"{b}/v1", "drafts": True},))
        app = build_app(lambda: started_gateway(s, progress=False))
        with serve_in_thread(app, lifespan="on") as url:
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=600)

            def ask(q: str, headers: dict[str, str] | None = None) -> tuple[str, str, float, int, int]:
                d0, a0 = engine.stats().spec_decode_draft_tokens, engine.stats().spec_decode_accepted_tokens
                t = time.perf_counter()
                raw = c.chat.completions.with_raw_response.create(
                    model="m",
                    messages=[{"role": "user", "content": q}],
                    temperature=0,
                    max_tokens=args.max_tokens,
                    extra_headers=headers,
                )
                secs = time.perf_counter() - t
                st = engine.stats()
                text = raw.parse().choices[0].message.content or ""
                drafted, accepted = st.spec_decode_draft_tokens - d0, st.spec_decode_accepted_tokens - a0
                return text, raw.headers["x-cache-reason"], secs, drafted, accepted

            for i, (stored, near) in enumerate(PAIRS[: args.pairs]):
                ask(stored)
                got = {}
                for drafted in (True, False) if i % 2 == 0 else (False, True):
                    got[drafted] = ask(near, None if drafted else {"cache-control": "no-store"})
                on, off = got[True], got[False]
                rows.append(
                    {
                        "pair": i,
                        "reason": on[1],
                        "identical": on[0] == off[0],
                        "seconds_with_draft": round(on[2], 3),
                        "seconds_without": round(off[2], 3),
                        "speedup": round(off[2] / on[2], 3),
                        "accepted_with_draft": f"{on[4]}/{on[3]}",
                        "accepted_without": f"{off[4]}/{off[3]}",
                    }
                )
                r = rows[-1]
                say(f"near miss {i} ({r['reason']}): x{r['speedup']}, accepted {r['accepted_with_draft']}")
    engine.shutdown()
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for task in TASKS:
        r = [x for x in rows if x["task"] == task]
        if not r:
            continue
        drafted, accepted = sum(x["drafted"] for x in r), sum(x["accepted"] for x in r)
        off, on = sum(x["decode_s_off"] for x in r), sum(x["decode_s_ngram"] for x in r)
        out[task] = {
            "prompts": len(r),
            "decode_speedup": round(off / on, 3),
            "median_speedup": round(statistics.median(x["speedup"] for x in r), 3),
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "all_identical": all(x["identical"] for x in r),
        }
    return out


def plot(result: dict) -> None:
    """Decode speedup and acceptance per task (and the gateway's near misses), one bar each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["summary"])
    speedups = [result["summary"][t]["decode_speedup"] for t in names]
    accepted = [result["summary"][t]["acceptance"] or 0 for t in names]
    near = result.get("gateway_near_miss") or []
    if near:
        names.append("near miss (gateway draft, end to end)")
        speedups.append(sum(r["seconds_without"] for r in near) / sum(r["seconds_with_draft"] for r in near))
        drafted = sum(int(r["accepted_with_draft"].split("/")[1]) for r in near)
        accepted.append(sum(int(r["accepted_with_draft"].split("/")[0]) for r in near) / max(drafted, 1))
    names = [textwrap.fill(n, 12) for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    axes[0].bar(names, speedups, color="tab:blue")
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].set(ylabel="time without drafts / with")
    axes[1].bar(names, accepted, color="tab:gray")
    axes[1].set(ylabel="draft tokens accepted", ylim=(0, 1))
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(
        "Speculative decoding, batch 1, SmolLM2-135M float32 (ratios from interleaved runs)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(RESULTS / "spec.png", dpi=120)
    say("wrote bench/results/spec.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=lambda p: __import__("pathlib").Path(p), default=SHARED_DATA)
    ap.add_argument("--per-task", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="off/ngram pairs per prompt (medians)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=len(PAIRS), help="near-miss pairs through the gateway")
    ap.add_argument("--skip-gateway", action="store_true")
    ap.add_argument(
        "--batch-sizes",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[],
        help="only: summaries in batches of these sizes (e.g. 1,2,4,8), saved to spec_batches.json",
    )
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from bench/results/spec.json")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads((RESULTS / "spec.json").read_text()))
        return
    import torch

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    start = time.perf_counter()
    if args.batch_sizes:
        rows = batch_part(args)
        save("spec_batches", {
            "command": f"python -m bench.spec_decode --batch-sizes {','.join(map(str, args.batch_sizes))} "
            f"--repeats {args.repeats} --max-tokens {args.max_tokens}",
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "seconds": round(time.perf_counter() - start, 1),
            "batches": rows,
        })  # fmt: skip
        return
    rows = engine_part(args)
    gateway_rows = [] if args.skip_gateway else gateway_part(args)
    result = {
        "command": "python -m bench.spec_decode "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k not in ("data", "skip_gateway", "plot_only", "batch_sizes")
        ),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.perf_counter() - start, 1),
        "summary": summary(rows),
        "prompts": rows,
        "gateway_near_miss": gateway_rows,
    }
    for task, s in result["summary"].items():
        say(f"{task}: decode x{s['decode_speedup']} (median {s['median_speedup']}), acc. {s['acceptance']}")
    save("spec", result)
    plot(result)


if __name__ == "__main__":
    main()
