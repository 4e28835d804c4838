"""The OpenAI-compatible backend server, end to end: real SmolLM2 engine, real HTTP, real openai SDK.

One server for the module (loading the model is the slow part); every request is tiny so the
file stays well under a minute on a small CPU.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402

from cachegw.backend.config import load_engine_config  # noqa: E402
from cachegw.backend.core.async_engine import AsyncEngine  # noqa: E402
from cachegw.backend.core.engine import LLMEngine  # noqa: E402
from cachegw.backend.core.sampling_params import InvalidParameter, SamplingParams  # noqa: E402
from cachegw.backend.entrypoints.server import build_app  # noqa: E402
from testkit.servers import serve_in_thread  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
MAX_REQUEST_BYTES = 64_000
PARIS = [
    {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]
METRIC_NAMES = [
    "cachegw:prefix_cache_queries_total", "cachegw:prefix_cache_hits_total", "cachegw:kv_cache_usage_perc",
    "cachegw:num_preemptions_total", "cachegw:num_requests_running", "cachegw:num_requests_waiting",
    "cachegw:prompt_tokens_total", "cachegw:generation_tokens_total", "cachegw:time_to_first_token_seconds",
    "cachegw:time_per_output_token_seconds", "cachegw:e2e_request_latency_seconds",
    "cachegw:spec_decode_draft_tokens_total", "cachegw:spec_decode_accepted_tokens_total",
    "cachegw:compiled_decode_steps_total",
]  # fmt: skip


@dataclass
class Backend:
    url: str
    engine: AsyncEngine
    llm: LLMEngine
    client: openai.OpenAI
    http: httpx.Client

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once nothing runs and every KV block is back in the free queue."""
        bm = self.llm.block_manager
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.engine.stats()
            if s.num_running == 0 and s.num_waiting == 0 and bm.num_free_blocks == bm.num_blocks:
                return True
            time.sleep(0.05)
        return False


@pytest.fixture(scope="module")
def backend() -> Iterator[Backend]:
    cfg = load_engine_config(
        None, device="cpu", dtype="float32", quantization="none", kv_cache_tokens=1024, max_num_seqs=4
    )
    llm = LLMEngine(cfg)
    engine = AsyncEngine(llm)
    app = build_app(engine, MODEL, MAX_REQUEST_BYTES)
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with httpx.Client(base_url=url, timeout=60) as http:
            yield Backend(url, engine, llm, client, http)
    engine.shutdown()


@pytest.fixture(scope="module")
def paris(backend: Backend):
    return backend.client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=16)


def assert_error(
    resp: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    assert body["error"]["param"] == param and body["error"]["code"] == code, body
    return body["error"]


def sse_events(resp: httpx.Response) -> list[dict | str]:
    """Parse an SSE body strictly: only `data: ...` events, each ended by a blank line."""
    text = resp.read().decode()
    assert text.endswith("data: [DONE]\n\n")
    events: list[dict | str] = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# --- chat ------------------------------------------------------------------------------------


def test_chat_non_stream(paris) -> None:
    assert paris.id.startswith("chatcmpl-") and paris.object == "chat.completion" and paris.model == MODEL
    choice = paris.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert paris.usage.completion_tokens > 0 and paris.usage.prompt_tokens > 20
    assert paris.usage.prompt_tokens_details.cached_tokens is not None


def test_chat_stream_matches_non_stream(backend: Backend, paris) -> None:
    chunks = list(
        backend.client.chat.completions.create(
            model=MODEL, messages=PARIS, temperature=0, max_tokens=16, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == paris.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [paris.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == paris.usage.completion_tokens
    # The same prompt again: its full blocks come from the prefix cache.
    assert last.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_logprobs(backend: Backend) -> None:
    resp = backend.client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token  # greedy
    if resp.choices[0].finish_reason == "length":
        assert "".join(e.token for e in content) == resp.choices[0].message.content


# --- completions -----------------------------------------------------------------------------


def test_completions_stream_and_non_stream(backend: Backend) -> None:
    body = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "temperature": 0,
        "max_tokens": 8,
        "ignore_eos": True,
    }
    full = backend.http.post("/v1/completions", json=body).json()
    assert full["id"].startswith("cmpl-") and full["object"] == "text_completion" and full["model"] == MODEL
    assert full["usage"]["completion_tokens"] == 8 and full["choices"][0]["finish_reason"] == "length"
    assert "cached_tokens" in full["usage"]["prompt_tokens_details"]
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with backend.http.stream("POST", "/v1/completions", json=stream_body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == full["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_completions_sdk_and_logprobs(backend: Backend) -> None:
    resp = backend.client.completions.create(
        model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=4, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.text_offset[0] == 0 and all(len(top) >= 2 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == resp.choices[0].text


def test_repeated_prompt_is_cached(backend: Backend) -> None:
    prompt = "Prefix caching test: " + " ".join(f"item{i}" for i in range(30))
    first = backend.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    second = backend.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert second.usage.prompt_tokens > 32
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens_details.cached_tokens
    # Another tenant (cache_salt extension) never sees those blocks.
    salted = backend.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": "tenant-b"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_seed_reproducible(backend: Backend) -> None:
    def run(seed: int) -> str:
        r = backend.client.completions.create(
            model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=1.0, seed=seed
        )
        return r.choices[0].text

    assert run(1234) == run(1234)


def test_top_k_extension(backend: Backend) -> None:
    body = {"prompt": "The weather today is", "max_tokens": 4, "ignore_eos": True}
    greedy = backend.http.post("/v1/completions", json={**body, "temperature": 0}).json()
    top1 = backend.http.post("/v1/completions", json={**body, "temperature": 1.0, "top_k": 1}).json()
    assert top1["choices"][0]["text"] == greedy["choices"][0]["text"]


@pytest.mark.parametrize(
    "extreme",
    [{"temperature": 1e-50}, {"temperature": 5e-324}, {"temperature": 0.7, "top_p": 1e-50}, {"top_k": 10**9}],
)
def test_extreme_sampling_values_work_and_harm_no_other_request(backend: Backend, extreme: dict) -> None:
    """Before: temperature 1e-50 divided the logits into NaN, top_p 1e-50 (0 in float32) masked every
    token, and the failed step took every request in the batch down with it (500)."""
    body = {"model": MODEL, "prompt": "The weather today is", "max_tokens": 24, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        other = pool.submit(backend.http.post, "/v1/completions", json={**body, "temperature": 0})
        odd = backend.http.post("/v1/completions", json={**body, **extreme})
        assert odd.status_code == 200, odd.text
        assert other.result().status_code == 200
    if "top_k" not in extreme:  # all three leave only the most likely token: greedy
        greedy = other.result().json()["choices"][0]["text"]
        assert odd.json()["choices"][0]["text"] == greedy


def test_top_k_too_large_for_a_tensor_gets_400(backend: Backend) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 1.0, "top_k": 2**63}
    r = backend.http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"


def test_stop_strings(backend: Backend) -> None:
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "temperature": 0, "max_tokens": 12}
    text = backend.http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    stopped = backend.http.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert stopped["text"] == text[: text.index(stop)] and stopped["finish_reason"] == "stop"
    with backend.http.stream("POST", "/v1/completions", json={**body, "stop": stop, "stream": True}) as resp:
        chunks = [e for e in sse_events(resp) if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == stopped["text"]


# --- other endpoints -------------------------------------------------------------------------


def test_models_health_metrics(backend: Backend) -> None:
    models = backend.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert backend.http.get("/health").status_code == 200
    metrics = backend.http.get("/metrics")
    assert metrics.status_code == 200
    exposed = {
        line.split("{")[0].split(" ")[0] for line in metrics.text.splitlines() if not line.startswith("#")
    }
    for name in METRIC_NAMES:
        assert name in exposed or f"{name}_count" in exposed, name
    assert "cachegw:prefix_cache_queries_total_total" not in metrics.text


# --- bad input -------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"model": MODEL}, "messages"),
        (CHAT, {"messages": HELLO, "temperature": "hot"}, "temperature"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (CHAT, {"messages": HELLO, "temperature": 5}, "temperature"),
        (CHAT, {"messages": HELLO, "top_p": 0}, "top_p"),
        (CHAT, {"messages": HELLO, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": HELLO, "n": 0}, "n"),
        (CHAT, {"messages": HELLO, "logit_bias": {"99999999": 1}}, "logit_bias"),  # beyond the vocabulary
        (CHAT, {"messages": HELLO, "logit_bias": {"1": "up"}}, "logit_bias"),
        (CHAT, {"messages": HELLO, "priority": "low"}, "priority"),
        (CHAT, {"messages": HELLO, "priority": 1.5}, "priority"),
        (CHAT, {"messages": HELLO, "priority": 5000}, "priority"),  # bounded: ageing bounds each wait
        ("/v1/completions", {"prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of"),
        ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ],
)
def test_invalid_request(backend: Backend, path: str, body: dict, param: str) -> None:
    err = assert_error(backend.http.post(path, json=body), 400, param=param)
    assert err["type"] == "invalid_request_error"


def test_priority_is_accepted(backend: Backend) -> None:
    """vLLM's ``priority`` extension (lower first): honoured by the scheduler, not refused as unknown."""
    for path, body in ((CHAT, {"messages": HELLO}), ("/v1/completions", {"prompt": "x"})):
        r = backend.http.post(path, json={**body, "priority": 7, "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_malformed_json(backend: Backend) -> None:
    resp = backend.http.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert assert_error(resp, 400)["type"] == "invalid_request_error"


def test_context_length_exceeded(backend: Backend) -> None:
    limit = backend.llm.max_model_len
    ids = [28] * (limit + 10)
    err = assert_error(
        backend.http.post("/v1/completions", json={"prompt": ids}), 400, "prompt", "context_length_exceeded"
    )
    assert str(limit) in err["message"] and str(limit + 10) in err["message"]
    chat = {"messages": [{"role": "user", "content": "hi " * limit}]}
    err = assert_error(backend.http.post(CHAT, json=chat), 400, "prompt", "context_length_exceeded")
    assert str(limit) in err["message"]


def test_unknown_model_too_large_unknown_route(backend: Backend) -> None:
    resp = backend.http.post(CHAT, json={"model": "gpt-9", "messages": HELLO})
    assert_error(resp, 404, "model", "model_not_found")
    assert_error(
        backend.http.post(CHAT, content=b"x" * (MAX_REQUEST_BYTES + 1)), 413, code="request_too_large"
    )
    assert_error(backend.http.get("/v1/nothing"), 404)
    assert_error(backend.http.get(CHAT), 405)


# --- lifecycle -------------------------------------------------------------------------------


def test_client_disconnect_aborts(backend: Backend) -> None:
    aborted = backend.engine.num_aborted
    body = {"messages": PARIS, "max_tokens": 256, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=backend.url, timeout=30) as http, http.stream("POST", CHAT, json=body) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the role chunk
        assert next(line for line in lines if '"content"' in line)  # a generated token
    assert backend.wait_idle(), backend.engine.stats()
    assert backend.engine.num_aborted == aborted + 1


def test_concurrent_requests(backend: Backend) -> None:
    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=f"{backend.url}/v1", api_key="unused", max_retries=0, timeout=60)
        async with client:
            return await asyncio.gather(
                *[client.completions.create(model=MODEL, prompt=f"Fact {i}:", max_tokens=6) for i in range(4)]
            )

    results = asyncio.run(main())
    assert len({r.id for r in results}) == 4
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    assert backend.wait_idle()


def test_generate_api(backend: Backend) -> None:
    """AsyncEngine.generate: validation errors raise before any output; closing early aborts."""
    aborted = backend.engine.num_aborted

    async def main() -> None:
        with pytest.raises(InvalidParameter) as info:
            async for _ in backend.engine.generate("gen-bad", [1] * 9000, SamplingParams(max_tokens=4)):
                pass
        assert info.value.code == "context_length_exceeded"
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        async for out in backend.engine.generate("gen-early-exit", "Hello there", params):
            assert not out.finished
            break

    asyncio.run(main())
    assert backend.wait_idle()
    assert backend.engine.num_aborted == aborted + 1


def break_next_step(runner, monkeypatch: pytest.MonkeyPatch) -> None:
    real_execute = runner.execute

    def broken_once(batch):
        monkeypatch.setattr(runner, "execute", real_execute)
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(runner, "execute", broken_once)


def test_engine_error_fails_only_that_request(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    break_next_step(backend.llm.runner, monkeypatch)
    resp = backend.http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
    err = assert_error(resp, 500, code="engine_error")
    assert err["type"] == "server_error" and "simulated kernel failure" in err["message"]
    assert backend.wait_idle()
    break_next_step(backend.llm.runner, monkeypatch)
    body = {"messages": HELLO, "max_tokens": 4, "stream": True}
    with backend.http.stream("POST", CHAT, json=body) as resp:
        assert resp.status_code == 200  # the stream had started: the error comes as an event
        events = sse_events(resp)
    assert events[-2]["error"]["code"] == "engine_error" and events[-1] == "[DONE]"
    assert backend.wait_idle()
    ok = backend.http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert backend.http.get("/health").status_code == 200
