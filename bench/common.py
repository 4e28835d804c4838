"""Helpers every benchmark shares: machine facts, result files, progress lines."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# ../shared/data next to the repo, or next to a folder above it (a git worktree under ../wt/NAME);
# CACHEGW_SHARED_DATA names it outright
SHARED_DATA = Path(
    os.environ.get("CACHEGW_SHARED_DATA")
    or next(
        (p / "shared" / "data" for p in ROOT.parents if (p / "shared" / "data").is_dir()),
        ROOT.parent / "shared" / "data",
    )
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def machine() -> dict:
    import torch

    info = {
        "date": date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "device": "cpu",
        "load_average": [round(x, 2) for x in os.getloadavg()],  # uptime's 1/5/15 min, at save time
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    return info


def save(name: str, payload: dict, path: Path | None = None) -> Path:
    """bench/results/NAME.json, or ``path`` (the GPU check writes under its own folder)."""
    path = path or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    say(f"wrote {path}")
    return path


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]
