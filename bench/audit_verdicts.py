"""Which audit verdict agrees best with labels: the real engine (SmolLM2-135M, greedy) answers both
questions of labelled candidate pairs, and each way of deciding "the stored answer (to question 1) was
right for question 2" is scored against the pair's label (duplicate / same intent = right).

    .venv/bin/python -m bench.audit_verdicts [--pairs 60] [--data DIR] [--out bound17] [--threads 1]

Pairs, per data set, half right and half wrong, drawn with a fixed seed, each one the semantic tier
would judge (over the cosine threshold, no guard: ``gateway.offline.evidence_seed.seed_scores``):
- QQP: test-split pairs of ``qqp_dev.csv`` (the verifier never trained on them);
- banking77: each sampled text and its nearest other sampled text (what a cache lookup finds), right
  when both have the same intent.

Verdicts: identical answers (up to whitespace); identical or the answers' embedding cosine over a
line; identical or the pair verifier on the two answers; the model itself as a judge (asked through
the engine whether the stored answer answers the new question: "Yes" against "No" in its next-token
logprobs), alone and after "identical". Writes bench/results/<out>.json with the load average. One
torch thread by default: on this shared 2-core machine two threads decoded 6x slower (OpenMP waits).
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import SHARED_DATA, save, say
from bench.verifier_quality import split_qqp

COSINES = (0.8, 0.9, 0.95)
POOL = 3000  # QQP pairs scored to find candidates
TEXTS = 1500  # banking77 texts whose nearest neighbours are the candidates
JUDGE = (
    "A user asked: {question}\n\nA proposed answer: {answer}\n\n"
    "Is the proposed answer a correct answer to the user's question? Reply Yes or No."
)
Pairs = list[tuple[str, str, bool]]


def qqp_pairs(data: Path, rng: random.Random) -> Pairs:
    with open(data / "qqp_dev.csv", newline="") as f:
        _, test, _ = split_qqp(list(csv.DictReader(f)))
    return [(r["question1"], r["question2"], r["is_duplicate"] == "1") for r in rng.sample(test, POOL)]


def banking_pairs(data: Path, rng: random.Random) -> Pairs:
    from cachegw.gateway.offline.calibrate import gateway_encoder

    with open(data / "banking77_train.csv", newline="") as f:
        rows = rng.sample(list(csv.DictReader(f)), TEXTS)
    emb = gateway_encoder("auto").encode([r["text"] for r in rows])
    sims = emb @ emb.T
    np.fill_diagonal(sims, -1.0)
    nearest = sims.argmax(axis=1)
    return [
        (rows[i]["text"], rows[j]["text"], rows[i]["category"] == rows[j]["category"])
        for i, j in enumerate(nearest)
    ]


def candidates(pairs: Pairs, n: int) -> Pairs:
    """Half right, half wrong, among the pairs the semantic tier would judge."""
    from cachegw.gateway.cache.verifier_loader import load_verifier
    from cachegw.gateway.config import load_settings
    from cachegw.gateway.offline.evidence_seed import seed_scores

    s = load_settings(None)
    verifier = load_verifier(s.cache, s.engine.resolved_cache_dir)
    scores = seed_scores(
        [p[0] for p in pairs], [p[1] for p in pairs], s.canonicalize, verifier, s.cache.threshold
    )
    cand = [p for p, sc in zip(pairs, scores, strict=True) if not np.isnan(sc)]
    pos, neg = [p for p in cand if p[2]][: n // 2], [p for p in cand if not p[2]][: n // 2]
    say(f"{len(cand)} candidates of {len(pairs)} pairs; judging {len(pos)} right and {len(neg)} wrong")
    return pos + neg


def judged_yes(out: Any, tok: Any) -> bool:
    """The judge's verdict: its best "yes" token beats its best "no" token in the first position."""
    best = {"yes": -np.inf, "no": -np.inf}
    for token_id, lp in out.outputs[0].logprobs[0]["top"]:
        word = tok.decode([token_id]).strip().lower()
        if word in best:
            best[word] = max(best[word], lp)
    return bool(best["yes"] > best["no"])


def verdicts(pairs: Pairs, llm: Any, max_tokens: int) -> dict[str, np.ndarray]:
    """Every method's verdict per pair ("right" = True), and the labels under "label"."""
    from cachegw.backend.core.sampling_params import SamplingParams
    from cachegw.gateway.cache.verifier_loader import load_verifier
    from cachegw.gateway.config import load_settings
    from cachegw.gateway.offline.calibrate import gateway_encoder

    tok = llm.tokenizer

    def chat(text: str) -> str:
        return tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )

    start = time.perf_counter()
    texts = [q for p in pairs for q in p[:2]]
    outs = llm.generate([chat(t) for t in texts], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    answers = [o.outputs[0].text for o in outs]
    a, b = answers[0::2], answers[1::2]  # a: the stored answer (to question 1); b: question 2's own
    say(f"{len(answers)} answers in {time.perf_counter() - start:.0f} s")
    start = time.perf_counter()
    prompts = [chat(JUDGE.format(question=p[1], answer=x.strip())) for p, x in zip(pairs, a, strict=True)]
    judged = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20))
    judge = np.array([judged_yes(o, tok) for o in judged])
    say(f"{len(prompts)} judge verdicts in {time.perf_counter() - start:.0f} s")
    emb = gateway_encoder("auto").encode([*a, *b])
    cos = np.einsum("ij,ij->i", emb[: len(a)], emb[len(a) :])
    same = np.array([" ".join(x.split()) == " ".join(z.split()) for x, z in zip(a, b, strict=True)])
    s = load_settings(None)
    verifier = load_verifier(s.cache, s.engine.resolved_cache_dir)
    prob = np.array(
        [
            verifier.score(x, z, emb[i], emb[len(a) + i]) if x.strip() and z.strip() else 0.0
            for i, (x, z) in enumerate(zip(a, b, strict=True))
        ]
    )
    methods = {"label": np.array([p[2] for p in pairs]), "identical": same}
    for c in COSINES:
        methods[f"identical or answer cosine >= {c}"] = same | (cos >= c)
    methods["identical or verifier(answers) >= 0.5"] = same | (prob >= 0.5)
    methods["model as judge"] = judge
    methods["identical or model as judge"] = same | judge
    return methods


def score(methods: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    y = methods["label"]
    return {
        name: {
            "agreement": round(float((right == y).mean()), 3),
            "says_right_when_label_wrong": round(float(right[~y].mean()), 3),  # hides false hits
            "says_wrong_when_label_right": round(float((~right[y]).mean()), 3),  # invents false hits
            # the mean of the two per-class rates: the sets are unbalanced (banking77: few wrong pairs)
            "balanced_accuracy": round(float((right[y].mean() + (~right[~y]).mean()) / 2), 3),
        }
        for name, right in methods.items()
        if name != "label"
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=60, help="per data set, half right and half wrong")
    p.add_argument("--data", type=Path, default=SHARED_DATA)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--out", default="bound17")
    p.add_argument("--threads", type=int, default=1, help="torch threads (2 under load: 6x slower here)")
    args = p.parse_args()
    import torch

    from cachegw.backend import LLM

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    start = time.perf_counter()
    sets = {
        "qqp": candidates(qqp_pairs(args.data, random.Random(23)), args.pairs),
        "banking77": candidates(banking_pairs(args.data, random.Random(29)), args.pairs),
    }
    llm = LLM(compile="off", quantization="none", max_num_seqs=32)
    per_set = {name: verdicts(pairs, llm, args.max_tokens) for name, pairs in sets.items()}
    both = {k: np.concatenate([per_set[s][k] for s in per_set]) for k in per_set["qqp"]}
    results: dict[str, Any] = {name: score(m) for name, m in per_set.items()}
    results["both"] = score(both)
    for name, methods in results["both"].items():
        say(
            f"{name}: qqp {results['qqp'][name]['agreement']}, banking77 "
            f"{results['banking77'][name]['agreement']}, both {methods}"
        )
    save(
        args.out,
        {
            "audit_verdicts": {
                "pairs": {name: len(pairs) for name, pairs in sets.items()},
                "max_tokens": args.max_tokens,
                "methods": results,
                "seconds": round(time.perf_counter() - start),
                "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
            }
        },
    )


if __name__ == "__main__":
    main()
