"""bench/gpu_parity.py, the GPU check's parity step, run on the CPU at tiny size: the code that only a
lent GPU machine runs in full is exercised on every test run (the comparisons, the HF reference, the
engine's float32/bfloat16/fp8-KV/eager paths on a model made by transformers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import gpu_parity


def test_parity_on_cpu_tiny(tmp_path: Path) -> None:
    out = tmp_path / "parity.json"
    assert gpu_parity.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ok"] and all(result["passed"].values())
    # float32 against HF's own Llama: the same tokens and logprobs within float32 rounding
    assert result["float32_vs_hf"]["all_equal"]
    assert result["float32_vs_hf"]["max_logprob_difference"] < 1e-4
    # bfloat16 and an fp8 cache do change the numbers, so the comparisons see something to compare
    assert 0 < result["fp8_kv_vs_bfloat16"]["max_logprob_difference"] < 0.5
    assert result["bfloat16_vs_hf"]["max_logprob_difference"] > 0
    assert len(result["bfloat16_vs_hf"]["per_prompt"]) == len(gpu_parity.TINY.prompt_lens)
    assert {e["attention"] for e in result["engines"].values()} == {"torch"}  # no kernels on a CPU


def test_compare_finds_the_first_difference() -> None:
    a = gpu_parity.Run([[1, 2, 3, 4]], [[{1: -0.1}, {2: -0.2}, {3: -0.3}, {4: -0.4}]])
    b = gpu_parity.Run([[1, 2, 9, 4]], [[{1: -0.1}, {2: -0.25}, {9: -0.1, 3: -0.5}, {4: -9.0}]])
    result = gpu_parity.compare(a, b)
    assert result["per_prompt"] == [{"equal": False, "first_difference": 2, "share": 0.75}]
    # steps 0-2 compared (step 2's inputs still agree), step 3 after the split is not
    assert result["max_logprob_difference"] == 0.2
    assert not result["all_equal"]


def test_gpu_scripts_parse() -> None:
    """The two shell scripts of the GPU check are only ever run in full on a lent machine."""
    root = Path(__file__).resolve().parents[1]
    for script in ("bench/gpu_prepare.sh", "bench/gpu_check.sh"):
        res = subprocess.run(["bash", "-n", script], cwd=root, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr


def test_gpu_check_only_runs_the_named_steps(tmp_path: Path) -> None:
    """GPU_CHECK_ONLY: install, nvidia-smi and versions, then only the named steps. On this CPU machine
    they fail (no wheels to carry, no nvidia-smi, no CUDA; the KV decode exits 2), and the summary
    still reports each, as it would the first failure on a lent machine."""
    root = Path(__file__).resolve().parents[1]
    env = {
        "PATH": os.environ["PATH"], "HOME": str(tmp_path), "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable, "GPU_CHECK_ONLY": "decode-kv", "GPU_CHECK_SECONDS": "120",
    }  # fmt: skip
    res = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=root, env=env, capture_output=True, text=True)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    steps = {s["step"]: s for s in summary["steps"]}
    assert set(steps) - {"install"} == {"nvidia-smi", "versions", "decode-kv"}, res.stdout
    assert steps["decode-kv"]["rc"] == "2" and not summary["ok"]
    assert "no CUDA device" in (tmp_path / "out" / "decode.log").read_text()
