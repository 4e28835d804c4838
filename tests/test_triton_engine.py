"""The whole model with the Triton attention path gives the torch path's tokens.

Without CUDA it runs in a subprocess with TRITON_INTERPRET=1 (Triton's CPU interpreter, a flag that
only takes effect if set before triton is first imported) on the embedded SmolLM2. On a CUDA machine
the kernels run natively on the GPU, on a random Llama of SmolLM2's head shape (the GGUF does not
travel to a lent GPU machine; testkit/random_llama.py), without CUDA graphs so that both paths run
the same eager steps. Covers plain prefill, prefill over a cached prefix, and decode, in the real engine,
with the cache in the compute dtype and in int8 (then on the random Llama on the CPU too).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from testkit import triton_interpreter  # noqa: E402

ON_CUDA = torch.cuda.is_available()
SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile, torch
    from pathlib import Path
    from testkit import triton_interpreter
    triton_interpreter.patch()  # numpy >= 2.4 in the interpreter (a no-op for compiled kernels)
    torch.set_num_threads(2)
    from cachegw.backend import LLM, SamplingParams
    from cachegw.backend.executor.layers.kernel_check import self_check
    kv = sys.argv[1]  # the cache's format: auto (the compute dtype) or int8
    engine = dict(dtype="float32", quantization="none", kv_cache_tokens=1024, max_num_seqs=4,
                  kv_cache_dtype=kv)
    if torch.cuda.is_available() or kv != "auto":  # a random Llama of SmolLM2's head shape
        from testkit.random_llama import LlamaShape, save_random_llama
        model = save_random_llama(Path(tempfile.mkdtemp()), LlamaShape(576, 2, 9, 3, 64, 1536, 4096))
        device = "cuda" if torch.cuda.is_available() else "cpu"
        llm = LLM(str(model), device=device, enforce_eager=True, compile="off", **engine)
    else:
        llm = LLM(**engine)
    runner = llm.engine.runner
    chosen = runner.attention_backend
    def use_triton(on):
        for layer in runner.model.layers:
            layer.self_attn.attn.use_triton = on
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(100, 140)), list(range(100, 120)) + list(range(300, 310))]
    use_triton(False)
    torch_out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, cache_salt="torch")]
    checked = self_check(runner.device, torch.float32, runner.spec, 16, runner.kv_format.storage_dtype)
    use_triton(True)
    cold = llm.generate(prompts, params, cache_salt="triton")  # plain prefill, then decode
    warm = llm.generate(prompts, params, cache_salt="triton")  # over the cached prefix the kernels wrote
    print(json.dumps({"device": runner.device.type, "chosen": chosen, "self_check": checked,
                      "torch": torch_out, "cold": [o.outputs[0].token_ids for o in cold],
                      "warm": [o.outputs[0].token_ids for o in warm],
                      "warm_cached": [o.num_cached_tokens for o in warm]}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_engine_with_triton_attention_matches_torch_path(kv: str) -> None:
    """auto: the cache in the compute dtype; int8: values and per-row scales written and read by the
    kernels. Either way the torch path's tokens, cold and from the prefix cache."""
    result = triton_interpreter.run_script(SCRIPT, kv)
    assert result["device"] == ("cuda" if ON_CUDA else "cpu")
    # on CUDA the engine itself picked the kernels (their start-up self-check passed); on CPU, the torch path
    assert result["chosen"] == ("triton" if ON_CUDA else "torch")
    assert result["self_check"] is True  # the start-up check the engine runs on CUDA
    assert result["cold"] == result["torch"]
    assert result["warm"] == result["torch"]
    assert result["warm_cached"] == [32, 16]
