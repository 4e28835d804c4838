#!/usr/bin/env bash
# Runs THERE: on a lent GPU machine, from the repo root, as the device tool's one command, after
# bench/gpu_prepare.sh filled .whl/ here:   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=600)
# Installs the wheels into /tmp/site, then runs each step under its own time limit, never stopping at
# a failure: the Triton attention tests and the engine's Triton test natively on CUDA, the engine's
# features on CUDA (tests/test_engine_on_device.py), the parity check (bench/gpu_parity.py), the
# decode benchmark (bench/gpu_decode.py) and a profile of a batch-1 decode step (bench/gpu_profile.py).
# Everything lands in $OUT (default ./gpu-results): the steps' 6 logs, parity.json, decode.json,
# profile.json and summary.json (what the tool brings back). No step starts past the deadline: the
# whole run ends within 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "${OUT:-./gpu-results}" && cd "${OUT:-./gpu-results}" && pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
DEADLINE=$((SECONDS + ${GPU_CHECK_SECONDS:-465}))
STEPS=() # name|rc|seconds|log|limit|from|to: the bytes of its log that are the step's own

# GPU_CHECK_ONLY="families decode-kv": only these steps (after install and versions), e.g. to recheck a
# fix on a second loan; decode-kv (the KV cache formats' decode alone) runs only when named there.
ONLY=${GPU_CHECK_ONLY:-}
ALWAYS=" install nvidia-smi versions "

# step NAME LIMIT_S LOG COMMAND...: the command under `timeout`, its output appended to $OUT/LOG
step() {
    local name=$1 limit=$2 log=$3 t0=$SECONDS rc from
    shift 3
    if [[ $ALWAYS != *" $name "* ]]; then
        if [[ -n $ONLY && " $ONLY " != *" $name "* ]] || [[ -z $ONLY && $name == decode-kv ]]; then
            return
        fi
    fi
    from=$(stat -c %s "$OUT/$log" 2>/dev/null || echo 0)
    ((limit > DEADLINE - SECONDS)) && limit=$((DEADLINE - SECONDS))
    if ((limit < 10)); then
        echo "== $name: not started, out of time" | tee -a "$OUT/$log"
        STEPS+=("$name|skipped|0|$log|0|$from|")
        return
    fi
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/$log"
    timeout -k 10 "$limit" "$@" >>"$OUT/$log" 2>&1
    rc=$?
    STEPS+=("$name|$rc|$((SECONDS - t0))|$log|$limit|$from|$(stat -c %s "$OUT/$log")")
    tail -n 4 "$OUT/$log"
    echo "   -> rc=$rc in $((SECONDS - t0))s"
}

VERSIONS='
import importlib.metadata as md, sys, torch
print("python", sys.version.split()[0])
for name in ("torch", "triton", "transformers", "safetensors", "numpy", "pytest", "pydantic",
             "pydantic-core", "typing-extensions"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "MISSING")
print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available())
assert torch.cuda.is_available(), "no CUDA device"
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
from cachegw.backend import LLM  # the engine, its pydantic config included
from cachegw.backend.executor.layers.triton_attention import triton_available
assert triton_available(), "triton does not import"
print("engine imports ok")
'

if compgen -G ".whl/*.whl" >/dev/null; then
    step install 90 setup.log "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
    echo "no .whl/: run bench/gpu_prepare.sh here first, then carry .whl" | tee -a "$OUT/setup.log"
    STEPS+=("install|1|0|setup.log|0|0|")
fi
step nvidia-smi 20 setup.log nvidia-smi
step versions 60 setup.log "$PY" -c "$VERSIONS"

# (a) the kernels natively on CUDA: the correctness tests in 4 processes (their Triton compiles are most
# of the time), then the timing test alone (-s: it prints Triton's and torch's decode times)
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 4)
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider)
step triton-attention 150 pytest_attention.log "${PYTEST[@]}" "${XDIST[@]}" tests/test_triton_attention.py \
    tests/test_triton_kv_formats.py -k "not test_cuda_decode_speed"
step triton-speed 60 pytest_attention.log "${PYTEST[@]}" -s tests/test_triton_attention.py -k test_cuda_decode_speed
step triton-engine 90 pytest_engine.log "${PYTEST[@]}" tests/test_triton_engine.py
step triton-fused 90 pytest_engine.log "${PYTEST[@]}" tests/test_triton_fused.py
# the engine's features (prefix cache, preemption, speculation, grammars, seeds, LoRA, RAM tier, H2O,
# int8/fp8 KV, stops, prompt logprobs) against the same engine without them; -v names each test as it
# ends, so a run cut short still says how far it got; a test hanging past 45 s fails with its stack;
# -s: the KV dtypes' agreement figures land in the log
PER_TEST=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout 45)
step engine-features 90 pytest_engine.log "$PY" -m pytest -v -s -rs -p no:cacheprovider "${PER_TEST[@]}" \
    tests/test_engine_on_device.py
# the families beyond Llama (Qwen3 q/k norms, Gemma 2 soft-caps and windows, Gemma 3 rope per layer kind,
# Phi-3) on CUDA against transformers on the CPU: tokens and logprobs, again from the prefix cache
step families 45 pytest_engine.log "${PYTEST[@]}" tests/test_model_families.py -k test_new_family_matches_transformers
# (b) our tokens against HF's: float32, bfloat16, fp8 KV, CUDA graphs against eager
step parity 150 parity.log "$PY" -m bench.gpu_parity --device cuda --out "$OUT/parity.json"
# (c) Llama-3-8B-shaped decode against the bandwidth bound and HF generate (sizes cut to fit)
step decode 220 decode.log "$PY" -m bench.gpu_decode --concurrency 32 64 --prompt-len 256 --new-tokens 128 \
    --batch1-tokens 128 --out "$OUT/decode.json"
# (d) where a batch-1 decode step's time goes (kernel groups per step, graphs and eager)
step profile 90 profile.log "$PY" -m bench.gpu_profile --out "$OUT/profile.json"
step decode-kv 150 decode.log "$PY" -m bench.gpu_decode --kv-only --concurrency 64 --out "$OUT/decode.json"

"$PY" - "$OUT" "$SECONDS" "${STEPS[@]}" <<'PY' || echo '{"ok": false, "error": "the summary failed"}' >"$OUT/summary.json"
import json, sys
from pathlib import Path

out, seconds = Path(sys.argv[1]), int(sys.argv[2])
steps = []
for entry in sys.argv[3:]:
    name, rc, secs, log, limit, start, end = entry.split("|")
    status = {"0": "passed", "skipped": "skipped", "124": "timed out", "137": "timed out"}.get(rc, "failed")
    text = (out / log).read_bytes()[int(start) : int(end) if end else None].decode(errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    record = {"step": name, "status": status, "rc": rc, "seconds": int(secs), "limit_s": int(limit),
              "log": log, "last_line": lines[-1] if lines else ""}
    if status != "passed":
        record["log_tail"] = "\n".join(lines[-40:])
    steps.append(record)
results = {}
for name in ("parity", "decode", "profile"):
    path = out / f"{name}.json"
    results[name] = json.loads(path.read_text()) if path.exists() else None
parity = results["parity"] or {}
decode = results["decode"] or {}
summary = {
    "ok": all(s["status"] == "passed" for s in steps),
    "seconds": seconds,
    "steps": steps,
    "parity": {k: parity.get(k) for k in ("ok", "passed", "engines")}
    | {k: {f: parity[k][f] for f in ("all_equal", "share", "max_logprob_difference")}
       for k in ("float32_vs_hf", "bfloat16_vs_hf", "fp8_kv_vs_bfloat16", "int8_kv_vs_bfloat16",
                 "graphs_vs_eager_float32", "graphs_vs_eager") if k in parity},
    "decode": {k: decode.get(k) for k in ("bound_tok_per_s", "batch1_decode_tok_per_s", "fraction_of_bound",
                                          "fused_elementwise", "batch1_unfused_tok_per_s", "kv_dtype_decode",
                                          "runs")},
    "profile": {mode: {k: (results["profile"] or {}).get(mode, {}).get(k)
                       for k in ("step_ms", "kernel_ms_per_step", "groups_ms_per_step")}
                for mode in ("graphs", "eager")} | {"bound_ms": (results["profile"] or {}).get("bound_ms")},
}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
PY
cat "$OUT/summary.json"
