"""The whole model with the Triton attention path gives the torch path's tokens.

Runs in a subprocess with TRITON_INTERPRET=1 (Triton's CPU interpreter), since that flag only
takes effect if set before triton is first imported. On a CUDA machine the same check runs on
the GPU. Covers plain prefill, prefill over a cached prefix, and decode, in the real engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is not installed")

SCRIPT = textwrap.dedent(
    """
    import json, torch
    torch.set_num_threads(2)
    from cachegw.backend import LLM, SamplingParams
    llm = LLM(dtype="float32", quantization="none", kv_cache_tokens=1024, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [list(range(100, 140)), list(range(100, 120)) + list(range(300, 310))]
    torch_out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, cache_salt="torch")]
    from cachegw.backend.executor.layers.kernel_check import self_check
    checked = self_check(torch.device("cpu"), torch.float32, llm.engine.runner.spec, 16)
    for layer in llm.engine.runner.model.layers:
        layer.self_attn.attn.use_triton = True
    cold = llm.generate(prompts, params, cache_salt="triton")  # plain prefill, then decode
    warm = llm.generate(prompts, params, cache_salt="triton")  # over the cached prefix
    print(json.dumps({"self_check": checked, "torch": torch_out,
                      "cold": [o.outputs[0].token_ids for o in cold],
                      "warm": [o.outputs[0].token_ids for o in warm],
                      "warm_cached": [o.num_cached_tokens for o in warm]}))
    """
)


@pytest.mark.slow
def test_engine_with_triton_attention_matches_torch_path():
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["self_check"] is True  # the start-up check the engine runs on CUDA
    assert result["cold"] == result["torch"]
    assert result["warm"] == result["torch"]
    assert result["warm_cached"] == [32, 16]
