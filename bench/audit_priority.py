"""Do low-priority audits delay client requests in the built-in engine? Engine steps, not seconds.

    .venv/bin/python -m bench.audit_priority [--audits 8] [--clients 4] [--rounds 1]

A busy engine (``max_num_seqs`` 4): ``--audits`` audit re-asks are queued, then ``--clients`` client
requests arrive a moment later (same arrival second). Each round runs it twice, alternating: the audits
at ``[cache.audits] priority`` (10), and at the clients' priority (0, as before the field existed).
Reported: the engine steps until each client request finished, and until every audit did. Steps, not
wall time, so the figures do not depend on the load of a shared machine (the load average is saved
too). Results go under "audit_priority" in bench/results/bound17.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from bench.common import RESULTS, save, say

QUESTIONS = [
    "What is the capital of France?",
    "How do I reset my card PIN?",
    "Why is the sky blue?",
    "Name three prime numbers.",
    "What does a compiler do?",
    "How far is the Moon?",
]


def run(llm: object, audits: int, clients: int, audit_priority: int, max_tokens: int) -> dict[str, float]:
    """Steps until the clients finished (mean, max) and until the last audit finished."""
    from cachegw.backend.core.sampling_params import SamplingParams

    engine = llm.engine  # type: ignore[attr-defined]
    tok = engine.tokenizer

    def prompt(q: str) -> list[int]:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        return tok.encode(text, add_special_tokens=False)

    base = f"r{audit_priority}-{os.urandom(4).hex()}"
    for i in range(audits):
        p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=audit_priority)
        engine.add_request(f"{base}-audit-{i}", prompt(QUESTIONS[i % len(QUESTIONS)]), p, arrival_time=1000.0)
    for i in range(clients):
        p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(
            f"{base}-client-{i}", prompt(QUESTIONS[-1 - i % len(QUESTIONS)]), p, arrival_time=1000.5
        )
    done: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = step
    client = [s for r, s in done.items() if "-client-" in r]
    audit = [s for r, s in done.items() if "-audit-" in r]
    return {"client_mean": statistics.mean(client), "client_max": max(client), "audits_done": max(audit)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--audits", type=int, default=8)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1, help="steps are deterministic (greedy): one is enough")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import torch

    from cachegw.backend import LLM
    from cachegw.gateway.config import load_settings

    torch.set_num_threads(args.threads)
    priority = load_settings(None).cache.audits.priority
    load_before = os.getloadavg()
    llm = LLM(compile="off", quantization="none", max_num_seqs=4, enable_prefix_caching=False)
    runs: dict[str, list[dict[str, float]]] = {
        "audits at priority 0": [],
        f"audits at priority {priority}": [],
    }
    for r in range(args.rounds):  # alternating, in one process
        for name, prio in (("audits at priority 0", 0), (f"audits at priority {priority}", priority)):
            runs[name].append(run(llm, args.audits, args.clients, prio, args.max_tokens))
            say(f"round {r}: {name}: {runs[name][-1]}")
    path = RESULTS / "bound17.json"
    payload = (
        {k: v for k, v in json.loads(path.read_text()).items() if k != "machine"} if path.exists() else {}
    )
    payload["audit_priority"] = {
        "audits": args.audits,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "max_num_seqs": 4,
        "runs": runs,
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
    }
    save("bound17", payload)


if __name__ == "__main__":
    main()
