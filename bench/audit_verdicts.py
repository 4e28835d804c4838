"""Which answer comparison makes an audit agree with labels: the real engine (SmolLM2-135M, greedy)
answers both questions of labelled QQP candidate pairs, and each way of comparing the two answers is
scored against the pair's label (duplicate = the stored answer was right for the new question).

    .venv/bin/python -m bench.audit_verdicts [--pairs 60] [--data DIR]

Pairs: test-split QQP pairs that the semantic tier would judge (over the cosine threshold, no guard:
``gateway.evidence_seed.seed_scores``), half duplicates, drawn with a fixed seed. Writes
bench/results/audit_verdicts.json.
"""

from __future__ import annotations

import argparse
import csv
import random
import time

import numpy as np

from bench.common import SHARED_DATA, save, say
from bench.verifier_quality import split_qqp

COSINES = (0.8, 0.85, 0.9, 0.95, 0.98)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=60)
    p.add_argument("--data", default=str(SHARED_DATA))
    args = p.parse_args()
    from backend import LLM
    from backend.sampling_params import SamplingParams
    from gateway.calibrate import _encoder
    from gateway.config import load_settings
    from gateway.evidence_seed import seed_scores
    from policies.verifier import load_verifier

    with open(f"{args.data}/qqp_dev.csv", newline="") as f:
        _, test, _ = split_qqp(list(csv.DictReader(f)))
    rng = random.Random(23)
    pool = rng.sample(test, 3000)
    s = load_settings(None)
    verifier = load_verifier(s.cache, s.engine.resolved_cache_dir)
    q1, q2 = [r["question1"] for r in pool], [r["question2"] for r in pool]
    scores = seed_scores(q1, q2, s.canonicalize, verifier, s.cache.threshold)
    cand = [i for i in range(len(pool)) if not np.isnan(scores[i])]
    pos = [i for i in cand if pool[i]["is_duplicate"] == "1"][: args.pairs // 2]
    neg = [i for i in cand if pool[i]["is_duplicate"] != "1"][: args.pairs // 2]
    picked = pos + neg
    say(f"{len(cand)} candidates of 3000 pairs; judging {len(pos)} duplicates and {len(neg)} others")
    llm = LLM(max_num_seqs=32)
    tok = llm.tokenizer

    def prompt(q: str) -> str:
        return tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )

    start = time.perf_counter()
    texts = [pool[i][k] for i in picked for k in ("question1", "question2")]
    outs = llm.generate([prompt(t) for t in texts], SamplingParams(max_tokens=24, temperature=0.0))
    answers = [o.outputs[0].text for o in outs]
    say(f"{len(answers)} answers in {time.perf_counter() - start:.0f} s")
    a, b = answers[0::2], answers[1::2]
    y = np.array([pool[i]["is_duplicate"] == "1" for i in picked])
    emb = _encoder("auto").encode([*a, *b])
    cos = np.einsum("ij,ij->i", emb[: len(a)], emb[len(a) :])
    same = np.array([" ".join(x.split()) == " ".join(z.split()) for x, z in zip(a, b, strict=True)])
    prob = np.array(
        [
            verifier.score(x, z, emb[i], emb[len(a) + i]) if x.strip() and z.strip() else 0.0
            for i, (x, z) in enumerate(zip(a, b, strict=True))
        ]
    )
    methods = {"identical": same}
    for c in COSINES:
        methods[f"identical or answer cosine >= {c}"] = same | (cos >= c)
    methods["identical or verifier(answers) >= 0.5"] = same | (prob >= 0.5)
    rows = {}
    for name, right in methods.items():
        rows[name] = {
            "agreement": round(float((right == y).mean()), 3),
            "says_right_when_label_wrong": round(float(right[~y].mean()), 3),  # hides false hits
            "says_wrong_when_label_right": round(float((~right[y]).mean()), 3),  # invents false hits
        }
        say(f"{name}: {rows[name]}")
    save("audit_verdicts", {"pairs": len(picked), "duplicates": int(y.sum()), "methods": rows})


if __name__ == "__main__":
    main()
