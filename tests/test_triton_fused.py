"""The fused Triton kernels (layers/triton_fused.py: RMSNorm with the residual, rotary, SiLU * up)
give the torch code's results, alone and inside the real engine.

Without CUDA everything runs in a subprocess with TRITON_INTERPRET=1 (Triton's CPU interpreter, which
truncates to bfloat16 where a GPU rounds: hence a tolerance of a few last places there). On a CUDA
machine the engine must have turned the kernels on by itself. Skipped where triton is not installed
(the CI machine); bench/gpu_check.sh runs it on a GPU.
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
    import json, tempfile, torch
    import torch.nn.functional as F
    from pathlib import Path
    from transformers import LlamaConfig
    from cachegw.backend import LLM, SamplingParams
    from cachegw.backend.executor.layers import triton_fused as tf
    from cachegw.backend.executor.layers.rotary import RotaryEmbedding
    from cachegw.backend.executor.models.llama import RMSNorm
    from testkit.random_llama import LlamaShape, save_random_llama

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=dev).manual_seed(1)
    kernels = {}
    for dtype in (torch.float32, torch.bfloat16):
        tol = 1e-5 if dtype == torch.float32 else 2.0**-6
        close = lambda a, b: a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
        for hidden in (96, 576, 4096):
            norm = RMSNorm(hidden, 1e-6).to(dev, dtype)
            norm.weight.data = torch.randn(hidden, device=dev, generator=g).to(dtype)
            for n in (1, 7):
                x = torch.randn(n, hidden, device=dev, generator=g).to(dtype)
                r = torch.randn(n, hidden, device=dev, generator=g).to(dtype)
                out, res = tf.rms_norm(x, r, norm.weight, norm.eps)
                want, want_res = norm(x, r)
                kernels[f"norm+res {dtype} {hidden} {n}"] = close(out, want) and close(res, want_res)
                alone = tf.rms_norm(x, None, norm.weight, norm.eps)
                kernels[f"norm {dtype} {hidden} {n}"] = close(alone, norm(x))
                gu = torch.randn(n, 2 * hidden, device=dev, generator=g).to(dtype)
                gate, up = gu.chunk(2, dim=-1)
                kernels[f"silu {dtype} {hidden} {n}"] = close(tf.silu_mul(gu), F.silu(gate) * up)
        for head_dim in (64, 128):
            rot = RotaryEmbedding(LlamaConfig(rope_theta=500000.0), head_dim, 256).to(dev)
            qkv = torch.randn(7, 12 * head_dim, device=dev, generator=g).to(dtype)
            q, k, _ = qkv.split([8 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
            q, k = q.view(7, 8, head_dim), k.view(7, 2, head_dim)  # strided views, as the model's
            pos = torch.randint(0, 256, (7,), device=dev, generator=g)
            got = tf.rotate(q, pos, rot.cos, rot.sin), tf.rotate(k, pos, rot.cos, rot.sin)
            want = rot(pos, q, k)
            kernels[f"rotary {dtype} {head_dim}"] = close(got[0], want[0]) and close(got[1], want[1])

    model = save_random_llama(Path(tempfile.mkdtemp()), LlamaShape(576, 2, 9, 3, 64, 1536, 4096))
    llm = LLM(str(model), device=dev.type, dtype="float32", quantization="none", kv_cache_tokens=1024,
              max_num_seqs=4, enforce_eager=True, compile="off")
    runner = llm.engine.runner
    chosen = runner.fused_elementwise
    flagged = lambda: sorted({type(m).__name__ for m in runner.model.modules()
                              if getattr(m, "triton", False)})
    def use(on):
        for m in runner.model.modules():
            if hasattr(m, "triton"):
                m.triton = False
        return tf.enable(runner.model, dev, torch.float32) if on else False
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = [list(range(100, 140)), list(range(300, 317))]
    use(False)
    plain = llm.generate(prompts, params, cache_salt="torch")
    enabled = use(True)
    on = flagged()
    fused = llm.generate(prompts, params, cache_salt="fused")
    diff = max(abs(x["logprob"] - y["logprob"])
               for a, b in zip(plain, fused) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs))
    print(json.dumps({"device": dev.type, "kernels": kernels, "chosen": chosen, "enabled": enabled,
                      "flagged": on,
                      "torch": [o.outputs[0].token_ids for o in plain],
                      "fused": [o.outputs[0].token_ids for o in fused], "max_logprob_diff": diff}))
    """
)


@pytest.mark.slow
def test_fused_kernels_match_the_torch_code_alone_and_in_the_engine() -> None:
    result = triton_interpreter.run_script(SCRIPT)
    assert result["device"] == ("cuda" if ON_CUDA else "cpu")
    failed = [name for name, ok in result["kernels"].items() if not ok]
    assert not failed, failed
    # on CUDA the engine turned them on itself (their start-up self-check passed); on a CPU, never
    assert result["chosen"] is ON_CUDA
    assert result["enabled"] is True
    assert result["flagged"] == ["LlamaMLP", "RMSNorm", "RotaryEmbedding"]
    assert result["fused"] == result["torch"]
    assert result["max_logprob_diff"] < 1e-4
