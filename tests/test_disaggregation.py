"""Prefill/decode disaggregation with real engines on loopback: a decode engine has its prompts computed by
a prefill engine, whose blocks reach it through a real Redis (or a shared folder), and answers exactly what
one engine doing both answers, streams included; a prefill engine refuses completions; a prefill engine
that is down costs only time. A tiny random Llama with SmolLM2's tokenizer stands in for the model."""

from __future__ import annotations

import gc
import json
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachegw.backend.core.kv_handover import reusable_hashes
from cachegw.backend.core.kv_redis import KEY_PREFIX
from testkit.random_llama import LlamaShape, save_random_llama
from testkit.servers import free_port, redis_available, redis_server, serve_in_thread

BS = 16
MESSAGES = [
    {"role": "system", "content": "You answer questions about the weather in the mountains. " * 8},
    {"role": "user", "content": "Will it snow on the pass tomorrow morning, and how much?"},
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from cachegw.backend.config import load_engine_config
    from cachegw.backend.executor.model_loader import resolve_model_dir

    cfg = load_engine_config(None)
    smol = resolve_model_dir(cfg.model, cfg.resolved_cache_dir)
    folder = tmp_path_factory.mktemp("tiny-disagg")
    save_random_llama(folder, LlamaShape(64, 2, 4, 2, 16, 128, 49152), max_positions=4096)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smol / name, folder / name)
    return folder


@contextmanager
def engine_server(model: Path, **engine: Any) -> Iterator[str]:
    """The built-in engine with these [engine] settings behind its HTTP server; yields its base URL."""
    from cachegw.backend.config import load_engine_config
    from cachegw.backend.core.async_engine import AsyncEngine
    from cachegw.backend.core.engine import LLMEngine
    from cachegw.backend.entrypoints.server import build_app

    cfg = load_engine_config(
        None, model=str(model), device="cpu", dtype="float32", compile="off", block_size=BS,
        kv_cache_tokens=4096, **engine,
    )  # fmt: skip
    async_engine = AsyncEngine(LLMEngine(cfg))
    try:
        with serve_in_thread(build_app(async_engine, "tiny", 1 << 20)) as url:
            yield url
    finally:
        async_engine.shutdown()
        del async_engine
        gc.collect()


@contextmanager
def pair(model: Path, write_behind: bool = True, **tier: Any) -> Iterator[tuple[str, str]]:
    """A prefill engine and a decode engine sharing ``tier``: (prefill URL, decode URL)."""
    with ExitStack() as stack:
        prefill = stack.enter_context(
            engine_server(model, role="prefill", kv_write_behind=write_behind, **tier)
        )
        peer = {"prefill_url": prefill, "prefill_min_tokens": BS, "kv_offload_bytes": 8 << 20}
        decode = stack.enter_context(engine_server(model, role="decode", **peer, **tier))
        yield prefill, decode


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    if not redis_available():
        pytest.skip("/usr/bin/redis-server is not installed")
    with redis_server() as url:
        yield url


@pytest.fixture(scope="module")
def single(tiny_model) -> Iterator[str]:
    """One engine doing both (no tier): the reference."""
    with engine_server(tiny_model) as url:
        yield url


@pytest.fixture(scope="module")
def redis_pair(tiny_model, redis_url) -> Iterator[tuple[str, str]]:
    # write-behind off: the blocks reach Redis only because /v1/prefill writes them before it answers
    with pair(tiny_model, write_behind=False, kv_offload_url=redis_url) as urls:
        yield urls


def chat(url: str, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_completion(url: str, prompt: list[int]) -> tuple[str, list[dict[str, Any]]]:
    """The text of a streamed completion and its chunks."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return text, chunks


def handovers(url: str) -> dict[str, float]:
    counts = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("cachegw:prefill_handovers_total{"):
            counts[line.split('"')[1]] = float(line.split()[-1])
    return counts


def in_redis(url: str, block_hash: bytes) -> bool:
    import redis

    with redis.Redis.from_url(url) as r:
        return any(True for _ in r.scan_iter(match=f"{KEY_PREFIX}*:{block_hash.hex()}"))


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_the_pair_answers_as_one_engine_and_the_prompt_comes_from_the_prefill_side(single, redis_pair):
    prefill, decode = redis_pair
    reference = chat(single, MESSAGES)
    answer = chat(decode, MESSAGES)
    assert answer["choices"][0]["message"] == reference["choices"][0]["message"]
    n = answer["usage"]["prompt_tokens"]
    assert n == reference["usage"]["prompt_tokens"] and n > 4 * BS
    assert cached(answer) == (n - 1) // BS * BS  # every reusable block came over; the last one computed here
    assert handovers(decode) == {"remote": 1.0}
    salted = chat(decode, MESSAGES, cache_salt="tenant-b")  # another tenant: its own blocks, computed again
    assert salted["choices"][0]["message"] == reference["choices"][0]["message"]
    assert cached(salted) == cached(answer) and handovers(decode)["remote"] == 2.0


def test_a_stream_from_the_pair_is_the_single_engines(single, redis_pair):
    rng = random.Random(4)
    prompt = [rng.randrange(100, 49000) for _ in range(7 * BS + 5)]
    expected, _ = streamed_completion(single, prompt)
    text, chunks = streamed_completion(redis_pair[1], prompt)
    assert text == expected and len(chunks) > 2
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 7 * BS
    again, _ = streamed_completion(redis_pair[1], prompt)  # its pool holds the prompt now: no hop
    assert again == expected and handovers(redis_pair[1]).get("local", 0) >= 1


def test_a_prefill_engine_refuses_completions_and_checks_its_body(redis_pair, redis_url):
    prefill, _ = redis_pair
    r = httpx.post(f"{prefill}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "prefill_only"
    assert "/v1/prefill" in r.json()["error"]["message"]
    for body in ({"prompt": []}, {"prompt": "text"}, {"prompt": [1, 2], "max_tokens": 3}):
        r = httpx.post(f"{prefill}/v1/prefill", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.post(f"{prefill}/v1/prefill", json={"prompt": [5] * 40, "model": "other"}, timeout=30)
    assert r.status_code == 404
    prompt = list(range(200, 240))
    r = httpx.post(f"{prefill}/v1/prefill", json={"prompt": prompt, "cache_salt": "s"}, timeout=30)
    assert r.json() == {"prompt_tokens": 40, "cached_tokens": 0, "handed_over_tokens": 32}
    assert all(in_redis(redis_url, h) for h in reusable_hashes(prompt, BS, "s"))  # there when it answered


def test_a_shared_folder_hands_over_too_and_a_prefill_engine_down_falls_back(single, tiny_model, tmp_path):
    reference = chat(single, MESSAGES)
    with pair(tiny_model, kv_offload_dir=str(tmp_path / "kv")) as (_, decode):
        answer = chat(decode, MESSAGES)
        assert answer["choices"][0]["message"] == reference["choices"][0]["message"]
        assert cached(answer) == (answer["usage"]["prompt_tokens"] - 1) // BS * BS
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    alone = {"prefill_url": dead, "prefill_min_tokens": BS, "kv_offload_dir": str(tmp_path / "alone")}
    with engine_server(tiny_model, role="decode", **alone) as url:
        answer = chat(url, MESSAGES)
        assert answer["choices"][0]["message"] == reference["choices"][0]["message"]
        assert cached(answer) == 0 and handovers(url) == {"fallback": 1.0}


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ({"role": "nope"}, "role is one of both, prefill, decode"),
        ({"role": "decode", "kv_offload_dir": "/tmp/x"}, "needs prefill_url"),
        ({"role": "prefill"}, "shared tier"),
        ({"prefill_url": "http://127.0.0.1:1"}, 'prefill_url is for role = "decode"'),
    ],
)
def test_a_bad_role_is_refused_at_start(keys, says):
    from cachegw.backend.config import load_engine_config

    with pytest.raises(ValueError, match="invalid engine config") as caught:
        load_engine_config(None, **keys)
    assert says in str(caught.value)


def test_the_command_refuses_an_unknown_role_and_a_decode_engine_without_its_prefill_engine(tmp_path):
    def backend(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "cachegw.gateway.cli", "backend", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    done = backend("--role", "decoder")
    assert done.returncode == 2 and "invalid choice: 'decoder'" in done.stderr
    config = tmp_path / "decode.toml"
    config.write_text(f'[engine]\nkv_offload_dir = "{tmp_path}"\n')
    done = backend("--config", str(config), "--role", "decode")
    assert done.returncode == 2 and 'role = "decode" needs prefill_url' in done.stderr


def test_behind_the_gateway_a_client_sees_one_streamed_request(single, redis_pair, tmp_path):
    """The gateway lists the decode engine as its backend: the OpenAI SDK's stream is the single engine's."""
    import openai

    from cachegw.gateway.api.app import build_app
    from cachegw.gateway.compose import started_gateway
    from cachegw.gateway.config import BackendSpec, load_settings

    messages = [
        {"role": "system", "content": "You plan hiking trips in the Alps for families with small children."},
        {"role": "user", "content": "Which hut near Zermatt can we reach in two hours from the valley?"},
    ]
    reference = chat(single, messages)["choices"][0]["message"]["content"]
    before = handovers(redis_pair[1]).get("remote", 0)
    settings = load_settings(None, data_dir=str(tmp_path), backends=(BackendSpec(url=f"{redis_pair[1]}/v1"),))
    app = build_app(lambda: started_gateway(settings, progress=False))
    with serve_in_thread(app, lifespan="on") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="tenant-a", max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text == reference
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // BS * BS
    assert handovers(redis_pair[1])["remote"] == before + 1
