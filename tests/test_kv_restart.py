"""The KV tier across a restart of the real `cachegw backend` process: a SIGTERM writes the pool's blocks
to disk before the process exits, and with write-behind even a kill -9 loses little. A tiny random Llama
with SmolLM2's tokenizer stands in for the model (a 5,000-token prompt in well under a second); what is
tested is the process's stop and start, not the model's numbers."""

from __future__ import annotations

import json
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from testkit.backend_process import complete, start_backend
from testkit.random_llama import LlamaShape, save_random_llama
from testkit.servers import free_port

PROMPT_TOKENS = 5000


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from cachegw.backend.config import load_engine_config
    from cachegw.backend.executor.model_loader import resolve_model_dir

    cfg = load_engine_config(None)
    smol = resolve_model_dir(cfg.model, cfg.resolved_cache_dir)
    folder = tmp_path_factory.mktemp("tiny-smol")
    save_random_llama(folder, LlamaShape(64, 2, 4, 2, 16, 128, 49152), max_positions=8192)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(33)
    return [[rng.randrange(100, 49000) for _ in range(PROMPT_TOKENS)] for _ in range(2)]


def config(tmp_path: Path, **engine: object) -> Path:
    keys = {
        "device": "cpu", "dtype": "float32", "compile": "off", "kv_cache_tokens": 16384,
        "kv_offload_dir": str(tmp_path / "kv"), **engine,
    }  # fmt: skip
    lines = [f"{k} = {json.dumps(v)}" for k, v in keys.items()]  # JSON's strings and booleans are TOML's
    path = tmp_path / "backend.toml"
    path.write_text("[engine]\n" + "\n".join(lines) + "\n")
    return path


def block_files(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "kv").rglob("*.kv"))


def test_a_sigterm_writes_the_pool_to_disk_and_write_behind_survives_a_kill_9(tiny_model, prompts, tmp_path):
    """Three starts of one server on one directory: stopped with SIGTERM (write-behind off: the blocks
    reach disk at shutdown only), then with kill -9 (write-behind on: they were written as filled)."""
    log, model = tmp_path / "backend.log", ("--model", str(tiny_model))
    first = start_backend(config(tmp_path, kv_write_behind=False), log, free_port(), *model)
    try:
        cold = complete(first, prompts[0])
        assert cold.prompt_tokens == PROMPT_TOKENS and cold.cached_tokens == 0
        assert block_files(tmp_path) == []  # nothing evicted, no write-behind: only the shutdown writes
    finally:
        assert first.stop(signal.SIGTERM) == 0
    assert len(block_files(tmp_path)) >= PROMPT_TOKENS // 16

    second = start_backend(config(tmp_path, kv_write_behind=True), log, free_port(), *model)
    try:
        warm = complete(second, prompts[0])
        other = complete(second, prompts[1])
        deadline = time.monotonic() + 120  # the worker writes behind the answer: wait for its files
        while len(block_files(tmp_path)) < 2 * (PROMPT_TOKENS // 16) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        second.stop(signal.SIGKILL)
    assert warm.cached_tokens >= 0.9 * PROMPT_TOKENS
    assert warm.text == cold.text and warm.text

    third = start_backend(config(tmp_path, kv_write_behind=False), log, free_port(), *model)
    try:
        again = complete(third, prompts[1])
    finally:
        third.stop()
    assert again.cached_tokens >= 0.9 * PROMPT_TOKENS and again.text == other.text
