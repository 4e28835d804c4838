"""What int8/int4 weights cost in accuracy against the float32 engine, on the embedded SmolLM2 GGUF.

- Greedy agreement: the first human turn of 64 ShareGPT conversations, chat template, N greedy tokens
  per mode compared with float32's: the share of positions before the first differing token, the
  share of equal tokens position by position, and the share of completions identical throughout.
- Perplexity, teacher-forced, on a fixed text set: the first answers of 16 other ShareGPT
  conversations (up to 256 tokens each), every position scored.

    .venv/bin/python -m bench.quant_accuracy [--prompts 64] [--tokens 32] [--threads 2]
        [--modes int8,int4,auto,auto+torch,llama.cpp] [--out quant_accuracy]

``+torch`` runs torch's int4/int8 kernels (`[engine] cpu_kernels = "torch"`: bfloat16 activations)
instead of cachegw's (int8 activations). ``llama.cpp`` runs the same GGUF file in llama-cpp-python
(greedy from the same prompt tokens, perplexity over the same texts): how far the reference
implementation of these weights sits from float32, for scale.
"""

from __future__ import annotations

import argparse
import gc
import json
import math

import torch

from bench.common import SHARED_DATA, save, say


def _conversations(n_prompts: int, n_texts: int) -> tuple[list[str], list[str]]:
    prompts: list[str] = []
    texts: list[str] = []
    with open(SHARED_DATA / "sharegpt_dev.jsonl") as f:
        for line in f:
            turns = json.loads(line)["conversations"]
            if len(turns) < 2 or turns[0]["from"] != "human" or turns[1]["from"] != "gpt":
                continue
            if len(prompts) < n_prompts:
                if len(turns[0]["value"]) < 2000:
                    prompts.append(turns[0]["value"])
            elif len(texts) < n_texts:
                texts.append(turns[1]["value"])
            else:
                break
    return prompts, texts


def _perplexity(llm, texts: list[str], max_len: int) -> float:
    """Teacher-forced: each text as one prefill into fresh KV blocks, logits at every position."""
    from cachegw.backend.executor.layers.attention import AttentionMetadata

    runner = llm.engine.runner
    nll, count = 0.0, 0
    for text in texts:
        ids = llm.tokenizer.encode(text, add_special_tokens=False)[:max_len]
        n = len(ids)
        meta = AttentionMetadata.one_prefill(n, runner.block_size)
        with torch.inference_mode():
            hidden = runner.model(torch.tensor(ids), torch.arange(n), meta)
            logp = torch.log_softmax(runner.model.compute_logits(hidden[:-1]), dim=-1)
        nll -= logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
        count += n - 1
    return math.exp(nll / count)


def _run(mode: str, prompts: list[str], texts: list[str], tokens: int) -> tuple[list[list[int]], float]:
    from cachegw.backend import LLM, SamplingParams

    weights, *flags = mode.split("+")
    # no prefix caching: the perplexity pass writes KV blocks outside the block manager
    llm = LLM(
        compile="off",
        quantization=weights,
        cpu_kernels="torch" if "torch" in flags else "auto",
        dtype="float32",
        kv_cache_tokens=32768,
        max_num_seqs=64,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    convs = [[{"role": "user", "content": p}] for p in prompts]
    outs = [list(o.outputs[0].token_ids) for o in llm.chat(convs, params)]
    ppl = _perplexity(llm, texts, 256)
    del llm
    gc.collect()
    return outs, ppl


def _run_llamacpp(
    prompts: list[str], texts: list[str], tokens: int, threads: int
) -> tuple[list[list[int]], float]:
    """The same GGUF in llama.cpp: greedy from our chat-templated prompt tokens; teacher-forced NLL."""
    import numpy as np
    from llama_cpp import Llama

    from cachegw.backend import LLM
    from cachegw.backend.executor.model_loader import embedded_gguf_path

    helper = LLM(load_format="dummy", compile="off", kv_cache_tokens=64)  # for its tokenizer and template
    tokenizer = helper.tokenizer
    model = Llama(str(embedded_gguf_path()), n_ctx=2048, n_threads=threads, logits_all=True, verbose=False)
    outs = []
    for p in prompts:
        ids = helper.chat_prompt_ids([{"role": "user", "content": p}])
        model.reset()
        got: list[int] = []
        for tok in model.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            got.append(int(tok))
            if len(got) == tokens:
                break
        outs.append(got)
    nll, count = 0.0, 0
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)[:256]
        model.reset()
        model.eval(ids)
        logits = np.asarray(model.scores[: len(ids) - 1], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll -= float(logp[np.arange(len(ids) - 1), ids[1:]].sum())
        count += len(ids) - 1
    del model
    gc.collect()
    return outs, math.exp(nll / count)


def _agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    prefix, equal, same = [], [], 0
    for a, b in zip(ref, got, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefix.append(first / len(a))
        equal.append(sum(x == y for x, y in zip(a, b, strict=True)) / len(a))
        same += a == b
    return {
        "mean_share_before_first_difference": round(sum(prefix) / len(prefix), 3),
        "mean_share_equal_positions": round(sum(equal) / len(equal), 3),
        "share_identical_completions": round(same / len(ref), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--texts", type=int, default=16)
    ap.add_argument("--modes", default="int8,int4,auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="quant_accuracy", help="bench/results/OUT.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts, texts = _conversations(args.prompts, args.texts)
    ref, ref_ppl = _run("none", prompts, texts, args.tokens)
    say(f"float32: perplexity {ref_ppl:.3f}")
    modes = {"none (float32)": {"perplexity": round(ref_ppl, 3)}}
    for mode in args.modes.split(","):
        if mode == "llama.cpp":
            got, ppl = _run_llamacpp(prompts, texts, args.tokens, args.threads)
        else:
            got, ppl = _run(mode, prompts, texts, args.tokens)
        modes[mode] = {"perplexity": round(ppl, 3), **_agreement(ref, got)}
        say(f"{mode}: {modes[mode]}")
    save(
        args.out,
        {"prompts": len(prompts), "new_tokens": args.tokens, "ppl_texts": len(texts), "modes": modes},
    )


if __name__ == "__main__":
    main()
