"""lm-evaluation-harness through our server equals lm-eval on transformers, item by item.

Runs the tiny local loglikelihood task in bench/data/lm_eval/ twice: with lm-eval's
``local-completions`` model against the built-in engine's OpenAI server (the app `cachegw backend`
serves, here in-process on a free loopback port; echo + logprobs + prompt token ids, as lm-eval
sends them), and with its ``hf`` model on the very same converted weights (the embedded SmolLM2
GGUF as transformers loads it, float32). Writes each item's two loglikelihoods, their largest
absolute difference and whether the greedy flags agree to bench/results/lm_eval_parity.json.

    python -m bench.lm_eval_parity            # needs the [bench] extra: pip install -e '.[bench]'
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from bench.common import ROOT, save, say

TASK_DIR = ROOT / "bench" / "data" / "lm_eval"
TASK = "cachegw_loglik"
MODEL = "SmolLM2-135M-Instruct"


@contextlib.contextmanager
def engine_server() -> Iterator[tuple[str, Path]]:
    """The engine's OpenAI server on loopback; yields its completions URL and the weights folder."""
    from cachegw.backend.config import load_engine_config
    from cachegw.backend.core.async_engine import AsyncEngine
    from cachegw.backend.core.engine import LLMEngine
    from cachegw.backend.entrypoints.server import build_app
    from testkit.servers import serve_in_thread

    llm = LLMEngine(
        load_engine_config(None, device="cpu", dtype="float32", quantization="none", kv_cache_tokens=8192)
    )
    engine = AsyncEngine(llm)
    try:
        with serve_in_thread(build_app(engine, MODEL, 1 << 22)) as url:
            yield f"{url}/v1/completions", llm.model_dir
    finally:
        engine.shutdown()


def per_item(results: dict) -> dict[int, tuple[float, bool]]:
    """doc_id -> (loglikelihood, is_greedy) from lm-eval's logged samples."""
    out = {}
    for sample in results["samples"][TASK]:
        ll, greedy = sample["resps"][0][0]
        out[int(sample["doc_id"])] = (float(ll), bool(greedy))
    return out


def evaluate(model: str, model_args: dict) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASK_DIR)),
        log_samples=True,
        batch_size=1,
    )


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.chdir(TASK_DIR)  # the task's data_files path is relative to it
    with engine_server() as (url, weights):
        say(f"lm-eval local-completions against {url}")
        ours = per_item(
            evaluate(
                "local-completions",
                {
                    "base_url": url, "model": MODEL, "tokenizer": str(weights),
                    "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_retries": 1,
                },
            )
        )  # fmt: skip
    say(f"lm-eval hf on {weights}")
    hf = per_item(evaluate("hf", {"pretrained": str(weights), "dtype": "float32", "device": "cpu"}))
    items = [
        {"doc_id": d, "server": ours[d][0], "hf": hf[d][0], "abs_diff": abs(ours[d][0] - hf[d][0]),
         "greedy_server": ours[d][1], "greedy_hf": hf[d][1]}
        for d in sorted(hf)
    ]  # fmt: skip
    worst = max(i["abs_diff"] for i in items)
    agree = sum(i["greedy_server"] == i["greedy_hf"] for i in items)
    say(f"{len(items)} items: max |loglikelihood difference| {worst:.2e}; greedy flags agree on {agree}")
    save(
        "lm_eval_parity",
        {
            "task": TASK, "items": len(items), "max_abs_diff": worst, "greedy_agree": agree,
            "per_item": items,
        },
    )  # fmt: skip


if __name__ == "__main__":
    main()
