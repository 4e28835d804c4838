"""bench/gpu_profile.py's bookkeeping, which only a lent GPU machine runs in full: kernel names into
groups, and device time into milliseconds per decode step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.gpu_profile import group_of, summarize


def test_kernel_names_fall_into_their_groups() -> None:
    names = {
        "_attn_kernel": "attention",
        "_merge_splits_kernel": "attention",
        "_store_kv_kernel": "kv store",
        "_rms_norm_kernel": "fused norm/rotary/silu",
        "_silu_mul_kernel": "fused norm/rotary/silu",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false>": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": "matmul",
        "nvjet_tst_64x8_64x16_4x1_v_bz_TNN": "matmul",
        "void at::native::reduce_kernel<512, 1, ReduceOp<float, ArgMaxOps<float>>>": "sampling",
        "Memcpy DtoD (Device -> Device)": "copy",
        "void at::native::vectorized_elementwise_kernel<4, CUDAFunctorOnSelf_add<float>>": "other",
        "void at::native::reduce_kernel<512, 1, ReduceOp<float, MeanOps<float, float>>>": "other",
    }
    assert {name: group_of(name) for name in names} == names


def test_summary_is_per_step_and_compares_with_the_step() -> None:
    kernels = [("_attn_kernel", 3200.0), ("gemv2T_kernel", 96000.0), ("_store_kv_kernel", 800.0)]
    got = summarize(kernels, steps=32, step_ms=4.0)
    assert got["groups_ms_per_step"] == {"matmul": 3.0, "attention": 0.1, "kv store": 0.025}
    assert got["kernel_ms_per_step"] == 3.125 and got["gpu_busy_share"] == round(3.125 / 4.0, 3)
    assert [k["kernel"] for k in got["top_kernels"]] == ["gemv2T_kernel", "_attn_kernel", "_store_kv_kernel"]


def test_without_cuda_it_writes_nothing_and_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "bench.gpu_profile", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    assert res.returncode == 2 and not out.exists()


def test_profiling_a_decode_runs_on_the_cpu(tmp_path: Path) -> None:
    """The profiler part on a tiny random Llama on the CPU: a decode step's wall time, no GPU kernels."""
    import json

    from bench.gpu_profile import profile_decode
    from cachegw.backend import LLM

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 512,
              "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(tmp_path), load_format="dummy", dtype="float32", max_model_len=512, compile="off")
    kernels, step_ms = profile_decode(llm, steps=6)
    assert kernels == [] and step_ms > 0
