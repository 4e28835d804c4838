"""The caching gateway end to end: the real built-in backend behind real HTTP, the real openai SDK.

One backend (the real SmolLM2 engine) for the module; gateways are started per test group on
their own data dirs so their caches never leak into each other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402

from cachegw.gateway.api.app import build_app  # noqa: E402
from cachegw.gateway.compose import started_gateway  # noqa: E402
from cachegw.gateway.config import Settings, load_settings  # noqa: E402
from testkit.servers import serve_in_thread  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}


def ask(text: str, system: dict = SYSTEM) -> list[dict]:
    return [system, {"role": "user", "content": text}]


@pytest.fixture(scope="module")
def backend_url(shared_backend_url: str) -> str:
    """The session's one built-in backend (tests/conftest.py); modules import this name."""
    return shared_backend_url


def settings_for(data_dir, backends: list[str], **cache_over) -> Settings:
    s = load_settings(None, data_dir=str(data_dir), backends=tuple(backends))
    return s.model_copy(update={"cache": s.cache.updated(cache_over)}) if cache_over else s


class MovableClock:
    """The cache's wall clock, moved forward by tests instead of sleeping through a TTL."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@contextlib.contextmanager
def gateway(settings: Settings, clock: Callable[[], float] = time.time) -> Iterator[str]:
    app = build_app(lambda: started_gateway(settings, progress=False, clock=clock))
    with serve_in_thread(app, lifespan="on") as url:
        yield url


def client(url: str, key: str = "tenant-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def chat(url: str, messages: list[dict], key: str = "tenant-a", **kw) -> tuple[str, dict, dict]:
    """(text, headers, usage) of a non-stream chat completion through the gateway."""
    raw = client(url, key).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        temperature=kw.pop("temperature", 0),
        max_tokens=kw.pop("max_tokens", 24),
        **kw,
    )
    completion = raw.parse()
    return completion.choices[0].message.content, dict(raw.headers), completion.usage.model_dump()


@pytest.fixture(scope="module")
def gw(backend_url, tmp_path_factory) -> Iterator[str]:
    with gateway(settings_for(tmp_path_factory.mktemp("gw"), [backend_url])) as url:
        yield url


def test_miss_then_exact_hit(gw):
    text1, h1, _ = chat(gw, ask("What is the capital of France?"))
    assert h1["x-cache"] == "miss" and "Paris" in text1
    text2, h2, _ = chat(gw, ask("What is the capital of France?"))
    assert h2["x-cache"] == "exact-hit" and text2 == text1
    assert h2["x-cache-entry"] and h2["x-request-id"] != h1["x-request-id"]


def test_whitespace_only_difference_is_an_exact_hit(gw):
    chat(gw, ask("Name a primary color."))
    _, h, _ = chat(gw, ask("Name a   primary color.  \r\n"))
    assert h["x-cache"] in ("exact-hit", "semantic-hit")


def test_stream_miss_then_stream_hit(gw):
    c = client(gw)
    messages = ask("Name a large ocean.")

    def stream() -> tuple[str, dict, dict | None]:
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        for chunk in raw.parse():
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage.model_dump()
        return text, dict(raw.headers), usage

    t1, h1, u1 = stream()
    assert h1["x-cache"] == "miss" and t1 and u1 is not None
    t2, h2, u2 = stream()
    assert h2["x-cache"] == "exact-hit" and t2 == t1 and u2 is not None
    # and the same answer as JSON
    t3, h3, _ = chat(gw, messages)
    assert h3["x-cache"] == "exact-hit" and t3 == t1


def test_paraphrase_is_a_semantic_hit_with_the_stored_answer(gw):
    t1, h1, _ = chat(gw, ask("How do I reset my password?"))
    assert h1["x-cache"] == "miss"
    t2, h2, _ = chat(gw, ask("How can I reset my password?"))
    assert h2["x-cache"] == "semantic-hit", h2
    assert t2 == t1 and float(h2["x-cache-similarity"]) >= 0.88


@pytest.mark.parametrize(
    "second",
    [
        ask(
            "How can I reset my password?", {"role": "system", "content": "You are a pirate. Talk like one."}
        ),
        [
            SYSTEM,
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How can I reset my password?"},
        ],
    ],
    ids=["other-system-prompt", "other-earlier-turn"],
)
def test_other_context_is_a_miss(gw, second):
    chat(gw, ask("How do I reset my password?"))
    _, h, _ = chat(gw, second)
    assert h["x-cache"] == "miss"


def test_other_tenant_is_a_miss(gw):
    chat(gw, ask("What is the tallest mountain?"), key="tenant-a")
    _, h, _ = chat(gw, ask("What is the tallest mountain?"), key="tenant-b")
    assert h["x-cache"] == "miss"


@pytest.mark.parametrize(
    ("first", "second"),
    [("What is 2+2?", "What is 2+3?"), ("Is the river Rhine long?", "Is the river Rhine not long?")],
    ids=["number", "negation"],
)
def test_changed_number_or_negation_is_a_miss(gw, first, second):
    chat(gw, ask(first))
    _, h, _ = chat(gw, ask(second))
    assert h["x-cache"] == "miss"


def test_no_cache_bypasses_and_no_store_stores_nothing(gw):
    messages = ask("What color is the sky on a clear day?")
    chat(gw, messages)
    _, h, _ = chat(gw, messages, extra_headers={"Cache-Control": "no-cache"})
    assert h["x-cache"] == "bypass"
    fresh = ask("What color is grass?")
    chat(gw, fresh, extra_headers={"Cache-Control": "no-store"})
    _, h, _ = chat(gw, fresh)
    assert h["x-cache"] == "miss"


def test_truncated_answer_is_not_served_to_a_longer_max_tokens(gw):
    messages = ask("Write a long poem about the sea.")
    chat(gw, messages, max_tokens=3)
    _, h, _ = chat(gw, messages, max_tokens=3)
    assert h["x-cache"] == "exact-hit"  # the same limit: the same (truncated) answer is right
    _, h, _ = chat(gw, messages, max_tokens=40)
    assert h["x-cache"] == "miss"


def test_sampling_requests_are_not_served_from_cache_by_default(gw):
    chat(gw, ask("Tell me a fun fact."), temperature=0)
    _, h, _ = chat(gw, ask("Tell me a fun fact."), temperature=0.8)
    assert h["x-cache"] == "bypass"


def test_models_health_metrics(gw):
    with httpx.Client(base_url=gw, timeout=30) as http:
        models = http.get("/v1/models", headers={"Authorization": "Bearer x"}).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert http.get("/health").json()["status"] == "ok"
        text = http.get("/metrics").text
        for name in (
            "cachegw_gateway_requests_total",
            "cachegw_gateway_hit_ratio",
            "cachegw_gateway_cache_entries",
            "cachegw_gateway_lookup_seconds",
            "cachegw_gateway_backend_cached_prompt_tokens_total",
        ):
            assert name in text


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err


def test_bad_input_gets_openai_errors(gw):
    h = {"Authorization": "Bearer tenant-a", "Content-Type": "application/json"}
    with httpx.Client(base_url=gw, timeout=30, headers=h) as http:
        error_of(http.post("/v1/chat/completions", content=b"{not json"), 400)
        err = error_of(http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"}), 400)
        assert err["param"] and err["param"].startswith("messages")
        err = error_of(http.post("/v1/chat/completions", json={"model": MODEL}), 400)
        assert err["param"] == "messages"
        err = error_of(
            http.post("/v1/chat/completions", json={"model": "no-such-model", "messages": ask("hi")}), 404
        )
        assert err["code"] == "model_not_found"
        big = {"model": MODEL, "messages": ask("x" * 5_000_000)}
        error_of(http.post("/v1/chat/completions", json=big), 413)
        err = error_of(
            http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": ask("hi")},
                headers={"x-cache-ttl": "soon"},
            ),
            400,
        )
        assert err["param"] == "x-cache-ttl"
        err = error_of(
            http.post("/v1/chat/completions", json={"model": MODEL, "messages": ask("hi"), "temperature": 9}),
            400,
        )
        assert err["param"] == "temperature"
        # each is counted for Prometheus by status and code (the module's gateway may have counted more)
        counted = {
            line.split("{")[1].split("}")[0]: float(line.split()[-1])
            for line in http.get("/metrics").text.splitlines()
            if line.startswith("cachegw_gateway_errors_total{")
        }
        assert counted['code="model_not_found",status="404"'] >= 1
        assert counted['code="request_too_large",status="413"'] >= 1
        assert sum(v for k, v in counted.items() if 'status="400"' in k) >= 5


def test_entries_survive_a_restart(backend_url, tmp_path):
    s = settings_for(tmp_path, [backend_url])
    with gateway(s) as url:
        text, h, _ = chat(url, ask("How do I bake bread?"))
        assert h["x-cache"] == "miss"
    with gateway(s) as url:  # a new process would rebuild the index from the database the same way
        text2, h, _ = chat(url, ask("How can I bake bread?"))
        assert h["x-cache"] == "semantic-hit" and text2 == text


def test_hnsw_scope_is_read_back_from_its_snapshot_after_a_restart(backend_url, tmp_path, caplog):
    """A scope past ``[index] hnsw_threshold`` is saved under <data_dir>/index and read back on start."""
    s = settings_for(tmp_path, [backend_url])
    s = s.model_copy(update={"index": s.index.model_copy(update={"hnsw_threshold": 3})})
    questions = ["How do I bake bread?", "Name a planet.", "What is a prime number?", "Who wrote Hamlet?"]
    with gateway(s) as url:
        answers = [chat(url, ask(q))[0] for q in questions]
    snaps = list((tmp_path / "index").glob("*.hnsw"))
    assert len(snaps) == 1  # one scope (same model, system prompt and tenant), saved on shutdown
    with caplog.at_level(logging.INFO, logger="cachegw.embeddings.index"), gateway(s) as url:
        text, h, _ = chat(url, ask("who wrote hamlet"))
        assert h["x-cache"] == "semantic-hit" and text == answers[3]
    assert "read from its snapshot: 4 entries, 0 added, 0 tombstoned" in caplog.text
    s_off = s.model_copy(update={"index": s.index.model_copy(update={"snapshots": False})})
    with gateway(s_off) as url:  # switched off: built from the database, and the old file is left alone
        text, h, _ = chat(url, ask("how do I bake bread"))
        assert h["x-cache"] == "semantic-hit" and text == answers[0]


def test_backend_down_gives_502_while_hits_are_still_served(backend_url, tmp_path):
    with gateway(settings_for(tmp_path, [backend_url])) as url:
        text, _, _ = chat(url, ask("Name a planet."))
    dead = "http://127.0.0.1:9/v1"  # nothing listens on the discard port
    with gateway(settings_for(tmp_path, [dead])) as url:
        text2, h, _ = chat(url, ask("Name a planet."))
        assert h["x-cache"] == "exact-hit" and text2 == text
        with httpx.Client(base_url=url, timeout=30) as http:
            r = http.post(
                "/v1/chat/completions",
                json={"messages": ask("Name a moon.")},
                headers={"Authorization": "Bearer tenant-a"},
            )
            err = error_of(r, 502)
            assert err["code"] == "backend_unavailable" and "127.0.0.1:9" in err["message"]
            body = {"messages": ask("Name a star."), "stream": True}
            r = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer tenant-a"})
            assert error_of(r, 502)["code"] == "backend_unavailable"
    # both in the request log (no temperature: 1.0, so not cacheable)
    assert failures_logged(tmp_path) == [(502, "bypass", "backend_unavailable")] * 2


def test_backend_timeout_gives_504_while_hits_are_still_served(backend_url, tmp_path):
    """A real timeout: the real engine cannot write 128 tokens in 50 ms on any machine we run on."""
    with gateway(settings_for(tmp_path, [backend_url])) as url:
        text, _, _ = chat(url, ask("Name a colour."))
    s = settings_for(tmp_path, [backend_url])
    s = s.model_copy(update={"gateway": s.gateway.model_copy(update={"backend_timeout_s": 0.05})})
    with gateway(s) as url:
        text2, h, _ = chat(url, ask("Name a colour."))
        assert h["x-cache"] == "exact-hit" and text2 == text
        with httpx.Client(base_url=url, timeout=30) as http:
            body = {"messages": ask("Write a long story about a fox."), "max_tokens": 128, "ignore_eos": True}
            r = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer tenant-a"})
            err = error_of(r, 504)
            assert err["code"] == "backend_timeout" and "did not answer in time" in err["message"]
            assert http.get("/health").json()["status"] == "ok"  # the gateway itself is fine
            metrics = http.get("/metrics").text
            assert 'cachegw_gateway_errors_total{code="backend_timeout",status="504"} 1.0' in metrics
    assert failures_logged(tmp_path) == [(504, "bypass", "backend_timeout")]


def failures_logged(data_dir) -> list[tuple[int, str, str]]:
    """(status, cache result, error code) of the failed requests in the request log."""
    with sqlite3.connect(data_dir / "cachegw.db") as db:
        rows = db.execute("SELECT status, cache_result, error FROM requests WHERE status >= 500").fetchall()
    return [(status, result, (error or "").split(":")[0]) for status, result, error in rows]


def test_canonicalization_raises_the_backends_prefix_hits(backend_url, tmp_path):
    """Two prompts that differ only in a timestamp and in whitespace: with canonicalization on, the
    long system prompt reaches the backend byte-identical and its prefix cache serves it."""

    def system(ts: str, base: str, newline: str = "\n") -> dict:
        return {"role": "system", "content": f"Current time: {ts}.{newline}{base}"}

    cached = {}
    for on in (True, False):
        base = (
            f"({'canonical' if on else 'raw'} run) "
            + "You are a careful support agent for a rocket company. " * 12
        )
        s = settings_for(tmp_path / str(on), [backend_url])
        s = s.model_copy(update={"canonicalize": s.canonicalize.model_copy(update={"enabled": on})})
        with gateway(s) as url:
            chat(url, [system("2026-11-22T10:00:00Z", base), {"role": "user", "content": "Say hello."}])
            messages = [
                system("2026-11-22T10:07:31Z", base + "  ", "\r\n"),
                {"role": "user", "content": "Name a fruit."},
            ]
            _, h, usage = chat(url, messages)
            assert h["x-cache"] == "miss"
            cached[on] = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached[True] >= 96, cached  # the whole system prompt, in full blocks
    assert cached[False] <= 16, cached  # only what precedes the timestamp


def test_keys_mode_refuses_unknown_keys(backend_url, tmp_path):
    s = settings_for(tmp_path, [backend_url])
    s = s.model_copy(
        update={"tenants": s.tenants.model_copy(update={"mode": "keys", "keys": {"alice": "sk-alice"}})}
    )
    with gateway(s) as url, httpx.Client(base_url=url, timeout=60) as http:
        body = {"model": MODEL, "messages": ask("Hi"), "max_tokens": 4, "temperature": 0}
        assert error_of(http.post("/v1/chat/completions", json=body), 401)["code"] == "invalid_api_key"
        r = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-mallory"})
        assert "Incorrect API key" in error_of(r, 401)["message"] and "sk-mallory" not in r.text
        assert (
            http.post(
                "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-alice"}
            ).status_code
            == 200
        )


def test_ttl_header_expires_an_entry(backend_url, tmp_path):
    clock = MovableClock()
    with gateway(settings_for(tmp_path, [backend_url]), clock) as url:
        messages = ask("Name a river in Africa.")
        chat(url, messages, extra_headers={"x-cache-ttl": "60"})
        _, h, _ = chat(url, messages)
        assert h["x-cache"] == "exact-hit"
        clock.advance(59)
        assert chat(url, messages)[1]["x-cache"] == "exact-hit"
        clock.advance(2)
        _, h, _ = chat(url, messages)
        assert h["x-cache"] == "miss"


def test_eviction_keeps_the_cache_within_budget_and_the_index_consistent(backend_url, tmp_path):
    with gateway(settings_for(tmp_path, [backend_url], max_entries=3)) as url:
        questions = ["Name a fruit.", "Name a vegetable.", "Name a metal.", "Name a gas.", "Name a bird."]
        for q in questions:
            chat(url, ask(q))
        admin = {"authorization": f"Bearer {(tmp_path / 'admin_token').read_text().strip()}"}
        health = httpx.get(f"{url}/health", headers=admin).json()  # counts need the admin token
        assert health["cache_entries"] <= 3
        _, h, _ = chat(url, ask("Name a fruit."))  # the least recently used: evicted, from the index too
        assert h["x-cache"] == "miss"
        _, h, _ = chat(url, ask("Name a bird."))
        assert h["x-cache"] == "exact-hit"
