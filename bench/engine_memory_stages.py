"""Where the engine's memory goes: resident set after each stage of one engine's start, in one process.

The stages are the engine's own steps, taken one at a time (`compile = "off"`, the embedded GGUF at
the defaults otherwise): python and torch, the engine's modules, the model's config, the tokenizer,
the weights (the model runner), then the HTTP server's modules; ``--model`` another model or GGUF
file (its folder converted first, in a child process, as the engine does). VmRSS after each, and VmHWM (the
peak so far) where a stage passed above its end. ``--tree DIR`` runs another build's tree (its config
and tokenizer read by transformers where it has no reader of its own). End-to-end peaks, with a
request answered, are ``bench/engine_memory.py``'s.

    .venv/bin/python -m bench.engine_memory_stages [--tree DIR] [--model PATH] [--out engine_memory_stages]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench.common import ROOT, save, say

_STAGES = r"""
import json, re, sys
def rss():
    s = open("/proc/self/status").read()
    return [round(int(re.search(k + r":\s+(\d+)", s).group(1)) / 1024, 1) for k in ("VmRSS", "VmHWM")]
out = []
import torch
out.append(["python + import torch", *rss()])
import cachegw.backend.core.engine
from cachegw.backend.config import load_engine_config
from cachegw.backend.executor.model_loader import gguf_source, resolve_model_dir
from cachegw.backend.executor.model_runner import ModelRunner
from cachegw.backend.executor.model_weights import needs_weight_files
from cachegw.backend.executor.platform import block_weights, resolve_device, resolve_dtype
config = load_engine_config(None, compile="off", **({"model": sys.argv[1]} if sys.argv[1:] else {}))
device, gguf = resolve_device(config.device), gguf_source(config.model)
kernels = block_weights(config, gguf, device)
folder = resolve_model_dir(config.model, config.resolved_cache_dir, needs_weight_files(config, gguf, device))
dtype = resolve_dtype(config.dtype, device, kernels())
out.append(["+ the engine's modules (and its CPU kernels)", *rss()])
try:
    from cachegw.backend.executor.model_config import read_model_config
    from cachegw.backend.core.tokenizer import open_tokenizer
except ImportError:  # a build without its own readers: transformers reads both
    from transformers import AutoConfig, AutoTokenizer
    read_model_config = lambda d: AutoConfig.from_pretrained(str(d))
    open_tokenizer = lambda d: AutoTokenizer.from_pretrained(str(d))
hf = read_model_config(folder)
out.append(["+ the model's config (" + type(hf).__name__ + ")", *rss()])
tokenizer = open_tokenizer(folder)
out.append(["+ the tokenizer (" + type(tokenizer).__name__ + ")", *rss()])
n = hf.max_position_embeddings
runner = ModelRunner(config, hf, folder, device, dtype, n, gguf_path=gguf, context=n)
out.append(["+ the weights (" + runner.quantization + ")", *rss()])
import cachegw.backend.entrypoints.server
out.append(["+ the HTTP server's modules", *rss()])
out.append(["transformers imported", "transformers" in sys.modules, "torch._dynamo" in sys.modules])
print(json.dumps(out))
"""


def stages(tree: Path, model: str | None = None) -> list[list]:
    cmd = [sys.executable, "-c", _STAGES, *([model] if model else [])]
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=None, help="another build's tree (default: this one)")
    ap.add_argument("--model", default=None, help="a model or GGUF file (default: the embedded model)")
    ap.add_argument("--out", default="engine_memory_stages", help="bench/results/OUT.json")
    args = ap.parse_args()
    tree = Path(args.tree) if args.tree else ROOT
    rows = stages(tree, args.model)
    for row in rows:
        say(" | ".join(str(x) for x in row))
    what = "VmRSS, VmHWM after each stage, MiB"
    save(args.out, {"tree": str(tree), "model": args.model, "what": what, "stages": rows})


if __name__ == "__main__":
    main()
