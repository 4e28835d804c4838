"""False hits, privacy and bad input found by an audit of the gateway, each checked end to end: the real
gateway in front of the real engine, real HTTP, the openai SDK where a client would use it.

Every test here failed on the code before the fix it pins (checked), except the end-to-end
concurrent-commit test, whose race depends on timing; the store-level test beside it fails reliably.
"""

from __future__ import annotations

import concurrent.futures
import json
import sqlite3
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI, Request

from cachegw.embeddings.index import ScopedIndex
from cachegw.gateway.cache.response_cache import ResponseCache
from cachegw.gateway.config import load_settings
from cachegw.gateway.storage.store import Store, sql_stores
from cachegw.gateway.storage.tables import CacheEntry
from cachegw.gateway.upstream.streams import SseRecorder
from cachegw.policies.cache_keys import request_keys
from testkit.servers import serve_in_thread
from tests.test_gateway import (  # noqa: F401
    MODEL,
    SYSTEM,
    MovableClock,
    ask,
    backend_url,
    chat,
    client,
    error_of,
    gateway,
    settings_for,
)

DATED = {"role": "system", "content": "You are a helpful assistant. Today is 2024-05-01."}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("edges")


CLOCK = MovableClock()  # the module gateway's wall clock: freshness tests move it instead of sleeping


@pytest.fixture(scope="module")
def gw(backend_url, data_dir) -> Iterator[str]:  # noqa: F811
    with gateway(settings_for(data_dir, [backend_url]), CLOCK) as url:
        yield url


def db_rows(data_dir, sql: str, *args) -> list[tuple]:
    with sqlite3.connect(data_dir / "cachegw.db") as db:
        return db.execute(sql, args).fetchall()


def logged(data_dir, request_id: str) -> tuple:
    """(query, rules_fired) of one request, once the recorder's batch has reached the database."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = db_rows(data_dir, "SELECT query, rules_fired FROM requests WHERE id = ?", request_id)
        if rows:
            return rows[0]
        time.sleep(0.1)
    raise AssertionError(f"{request_id} was never logged")


# ---- false hits ---------------------------------------------------------------------------------


def test_volatile_values_do_not_pull_questions_together(gw):
    """Canonicalization moves "2024-05-01" from the system prompt into a note on the last user message.
    That note was embedded with the question, so every question under one date looked alike ("undo git
    add" got "undo git commit"'s answer). Now the question is embedded alone and the date is scope."""
    chat(gw, ask("How do I reset my password?"))
    _, plain, _ = chat(gw, ask("How can I reset my password?"))
    assert plain["x-cache"] == "semantic-hit"
    t1, h1, _ = chat(gw, ask("How do I reset my password?", DATED))
    assert h1["x-cache"] == "miss"  # another scope than the undated one
    t2, h2, _ = chat(gw, ask("How can I reset my password?", DATED))
    assert h2["x-cache"] == "semantic-hit" and t2 == t1
    assert abs(float(h2["x-cache-similarity"]) - float(plain["x-cache-similarity"])) < 1e-3
    other_day = {"role": "system", "content": "You are a helpful assistant. Today is 2024-05-02."}
    _, h3, _ = chat(gw, ask("How can I reset my password?", other_day))
    assert h3["x-cache"] == "miss"  # an answer given under one date is not served under another


def test_the_name_on_the_last_message_is_part_of_the_scope(gw):
    alice = [SYSTEM, {"role": "user", "name": "alice", "content": "What is my name?"}]
    bob = [SYSTEM, {"role": "user", "name": "bob", "content": "What is my name?"}]
    chat(gw, alice)
    assert chat(gw, alice)[1]["x-cache"] == "exact-hit"
    assert chat(gw, bob)[1]["x-cache"] == "miss"  # was a semantic hit at similarity 1.0


def echo_backend() -> FastAPI:
    """A small OpenAI-compatible test server that honours ``echo`` (the built-in engine refuses it with a
    400), so the gateway has an echoed answer it could wrongly serve."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        body = await request.json()
        text = (body["prompt"] if body.get("echo") else "") + " Use the reset link."
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
        usage = {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12}
        return {"id": "c1", "object": "text_completion", "created": 0, "model": MODEL, "choices": [choice],
                "usage": usage}  # fmt: skip

    return app


def test_echo_is_never_a_semantic_hit(tmp_path):
    """With echo the answer starts with the prompt: a paraphrase would get the stored prompt back."""
    with serve_in_thread(echo_backend()) as url, gateway(settings_for(tmp_path, [f"{url}/v1"])) as gw:
        oai = client(gw)
        kw = {"model": MODEL, "max_tokens": 8, "temperature": 0, "echo": True}
        first = oai.completions.with_raw_response.create(prompt="How do I reset my password?", **kw)
        assert first.headers["x-cache"] == "miss"
        second = oai.completions.with_raw_response.create(prompt="How can I reset my password?", **kw)
        assert second.headers["x-cache"] == "miss"
        assert second.parse().choices[0].text.startswith("How can I")
        again = oai.completions.with_raw_response.create(prompt="How can I reset my password?", **kw)
        assert again.headers["x-cache"] == "exact-hit"


def schema_format(*fields: str) -> dict:
    props = {f: {"type": "string"} for f in fields}
    schema = {"type": "object", "properties": props, "required": sorted(fields)}
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_json_schema_property_order_is_part_of_the_key(gw):
    """Structured output is generated in the schema's property order: reasoning-then-answer is another
    request than answer-then-reasoning. Hashing with sorted keys had merged them."""
    q = ask("Is the sea salty?")
    chat(gw, q, response_format=schema_format("reasoning", "answer"))
    assert chat(gw, q, response_format=schema_format("reasoning", "answer"))[1]["x-cache"] == "exact-hit"
    assert chat(gw, q, response_format=schema_format("answer", "reasoning"))[1]["x-cache"] == "miss"


def test_cache_salt_separates_answers(gw):
    q = ask("Name a planet.")
    chat(gw, q, extra_body={"cache_salt": "user-1"})
    assert chat(gw, q, extra_body={"cache_salt": "user-1"})[1]["x-cache"] == "exact-hit"
    assert chat(gw, q, extra_body={"cache_salt": "user-2"})[1]["x-cache"] == "miss"


def test_request_max_age_limits_what_is_served(gw):
    q = ask("Name a colour of the rainbow.")
    chat(gw, q)
    assert chat(gw, q, extra_headers={"Cache-Control": "max-age=600"})[1]["x-cache"] == "exact-hit"
    CLOCK.advance(30)
    assert chat(gw, q, extra_headers={"Cache-Control": "max-age=60"})[1]["x-cache"] == "exact-hit"
    stale = chat(gw, q, extra_headers={"Cache-Control": "max-age=20"})[1]
    assert (stale["x-cache"], stale["x-cache-reason"]) == ("miss", "too-old")
    # min-fresh beyond the entry's remaining life (7 days by default): not served either
    assert chat(gw, q, extra_headers={"Cache-Control": "min-fresh=99999999"})[1]["x-cache"] == "miss"


def test_api_key_header_names_the_tenant(gw):
    """Azure-style clients send ``api-key``; they all shared the anonymous tenant before."""
    body = {"model": MODEL, "messages": ask("Name a fruit."), "temperature": 0, "max_tokens": 8}
    with httpx.Client(base_url=gw, timeout=120) as http:
        http.post("/v1/chat/completions", json=body, headers={"api-key": "key-one"})
        again = http.post("/v1/chat/completions", json=body, headers={"api-key": "key-one"})
        other = http.post("/v1/chat/completions", json=body, headers={"api-key": "key-two"})
    assert again.headers["x-cache"] == "exact-hit" and other.headers["x-cache"] == "miss"


def test_max_completion_tokens_zero_is_refused_even_when_an_answer_is_stored(gw):
    q = ask("Name a month.")
    chat(gw, q)
    with httpx.Client(base_url=gw, timeout=120, headers={"authorization": "Bearer tenant-a"}) as http:
        body = {"model": MODEL, "messages": q, "temperature": 0, "max_tokens": 24, "max_completion_tokens": 0}
        error_of(http.post("/v1/chat/completions", json=body), 400)


def test_answers_with_the_same_text_committed_at_once_are_all_stored(gw):
    """Different prompts with max_tokens 1 often share a one-token reply: the remembered reply's unique
    key failed the second commit, and its cache entry with it."""
    prompts = [f"Say one word about the number {n}." for n in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: chat(gw, ask(p), max_tokens=1), prompts))
    assert [chat(gw, ask(p), max_tokens=1)[1]["x-cache"] for p in prompts] == ["exact-hit"] * 8


def test_store_commits_entries_whose_replies_race_for_one_key(tmp_path):
    """Four commits at once, each an entry with the same new reply text: all land (insert-or-ignore)."""
    store = Store(f"sqlite:///{tmp_path / 'race.db'}")
    entries = sql_stores(store).entries
    errors: list[Exception] = []

    def add(key: str, barrier: threading.Barrier) -> None:
        now = time.time()
        entry = CacheEntry(tenant="t", model="m", endpoint="chat", scope="", exact_key=key, query_text="",
                           response="{}", finish_reason="stop", max_tokens=None, embedding=None,
                           prompt_tokens=0, completion_tokens=1, size_bytes=2, created_at=now,
                           expires_at=now + 60)  # fmt: skip
        barrier.wait()
        try:
            entries.add_entry(entry, {f"reply-{key[:2]}": "Yes"})
        except Exception as exc:  # noqa: BLE001 - the test reports any
            errors.append(exc)

    for round_ in range(20):
        barrier = threading.Barrier(4)
        threads = [threading.Thread(target=add, args=(f"{round_:02d}-{i}", barrier)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert entries.totals()[0] == 80
    store.close()


# ---- what is kept -------------------------------------------------------------------------------


def test_no_store_keeps_neither_the_reply_nor_the_query(gw, data_dir):
    q = ask("My account number is 998877. What should I do with it?")
    text, h, _ = chat(gw, q, extra_headers={"Cache-Control": "no-store"})
    query, _ = logged(data_dir, h["x-request-id"])
    assert query is None
    assert db_rows(data_dir, "SELECT count(*) FROM replies WHERE text = ?", text) == [(0,)]
    _, h2, _ = chat(gw, ask("Name a river."))
    assert logged(data_dir, h2["x-request-id"])[0] == "Name a river."  # the default logs the query


def test_earlier_replies_are_restored_only_for_the_tenant_that_got_them(gw, data_dir):
    """A tenant's reply text reshaping another tenant's prompt was a side channel between them."""
    q = ask("Name a large animal.")
    text, _, _ = chat(gw, q, key="tenant-a")
    follow = [*q, {"role": "assistant", "content": f"  {text}  "}, {"role": "user", "content": "Why?"}]
    _, ha, _ = chat(gw, follow, key="tenant-a")
    _, hb, _ = chat(gw, follow, key="tenant-b")
    assert "restore_assistant" in logged(data_dir, ha["x-request-id"])[1]
    assert "restore_assistant" not in logged(data_dir, hb["x-request-id"])[1]


# ---- bad input ----------------------------------------------------------------------------------

AUTH = {"authorization": "Bearer tenant-a", "content-type": "application/json"}


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/chat/completions", b'{"model":"%s","messages":[{"role":"user","content":"hi"}],'
         b'"temperature":NaN}', None),
        ("/v1/chat/completions", b'{"model":"%s","messages":[{"role":"user","content":"hi"}],'
         b'"metadata":{"x":Infinity}}', None),
        ("/v1/chat/completions", b'{"model":"%s","messages":[{"role":"user","content":"hi"}],'
         b'"top_p":1e400}', None),
        ("/v1/completions", b'{"model":"%s","prompt":"hi","n":1' + b"0" * 400 + b"}", "n"),
        ("/v1/chat/completions", b'{"model":"%s","messages":[{"role":"assistant","content":"a",'
         b'"tool_calls":5},{"role":"user","content":"hi"}]}', None),
        ("/v1/chat/completions", b'{"model":"","messages":[{"role":"user","content":"hi"}]}', "model"),
    ],
    ids=["nan", "infinity-in-an-ignored-field", "float-overflow", "huge-int", "tool-calls-not-a-list",
         "empty-model"],
)  # fmt: skip
def test_bad_bodies_get_a_400_not_a_500(gw, path, raw, param):
    raw = raw.replace(b"%s", MODEL.encode())
    with httpx.Client(base_url=gw, timeout=120, headers=AUTH) as http:
        for stream in (False, True):
            body = raw[:-1] + b',"stream":true}' if stream else raw
            err = error_of(http.post(path, content=body), 400)
            if param:
                assert err["param"] == param
        assert http.get("/health").json()["status"] == "ok"


def test_superscript_digits_in_the_ttl_header_get_a_400(gw):
    """``"²".isdigit()`` is True and ``int("²")`` raises: it was a 500."""
    body = {"model": MODEL, "messages": ask("hi"), "temperature": 0, "max_tokens": 4}
    with httpx.Client(base_url=gw, timeout=120, headers=AUTH) as http:
        r = http.post("/v1/chat/completions", json=body, headers={"x-cache-ttl": "²".encode("latin-1")})
    assert error_of(r, 400)["param"] == "x-cache-ttl"


# ---- stored answers ---------------------------------------------------------------------------


def test_a_streamed_refusal_is_not_stored_as_an_empty_answer():
    """The stream recorder kept only ``delta.content``: a refusal became a stored answer of ""."""
    recorder = SseRecorder("chat")
    for chunk in (
        {"id": "c1", "choices": [{"index": 0, "delta": {"role": "assistant", "refusal": "I can't"}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"refusal": " help with that."}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ):
        recorder.feed_event(b"data: " + json.dumps(chunk).encode())
    recorder.feed_event(b"data: [DONE]")
    message = recorder.complete_response()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "", "refusal": "I can't help with that."}


async def test_answers_without_usage_are_served_only_where_their_length_is_known(tmp_path):
    """A backend that sends no usage (some llama.cpp builds; the built-in engine always sends it, so
    the response is written here by hand) had its answer stored as 0 tokens long: served to any
    max_tokens. Now a "stop" answer is known to fit only the limit it was asked with."""
    store = Store(f"sqlite:///{tmp_path / 'usage.db'}")
    cache = ResponseCache(load_settings(None).cache, sql_stores(store), ScopedIndex(dim=4), None, None)
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "A long answer"},
                           "finish_reason": "stop"}]}  # fmt: skip

    async def served(asked_with: int | None, limit: int | None) -> bool:
        body = {"messages": ask(f"q{asked_with}"), "temperature": 0}
        stored = request_keys("t", "m", "chat", {**body, "max_tokens": asked_with})
        await cache.insert("t", "m", "chat", stored, None, answer, 60)
        keys = request_keys("t", "m", "chat", {**body, "max_tokens": limit})
        return (await cache.lookup("t", "t", "m", keys)).result == "exact-hit"

    assert await served(None, None) and not await served(None, 5)
    assert await served(100, 100) and await served(100, 200) and not await served(100, 5)
    store.close()


async def test_remembered_replies_are_pruned_and_flushed(tmp_path):
    """They were kept forever and survived a flush; now they live as long as the longest entry can."""
    settings = load_settings(None)
    clock = MovableClock()
    store = Store(f"sqlite:///{tmp_path / 'replies.db'}", clock)
    config = settings.cache.model_copy(update={"max_ttl_seconds": 60})
    stores = sql_stores(store)
    cache = ResponseCache(config, stores, ScopedIndex(dim=4), None, None)
    replies = stores.replies
    replies.remember_replies({"k-old": "an old reply"})
    clock.advance(61)
    replies.remember_replies({"k-new": "a new reply"})
    await cache.expire()
    assert replies.lookup_reply("k-old") is None and replies.lookup_reply("k-new") == "a new reply"
    replies.clear_replies()
    assert replies.lookup_reply("k-new") is None
    store.close()
