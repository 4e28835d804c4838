"""Several backends behind one gateway: prefix-affine routing, spreading, and failover.

The routing functions are checked on their own; then the real gateway in front of two real built-in
engines shows what the policy is for: every turn of a conversation reaches the backend that already holds
its prefix (its cached_tokens prove it), and a backend that stops answering is routed around.
"""

from __future__ import annotations

import gc
import json
import os
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import pytest  # noqa: E402

from cachegw.backend.config import load_engine_config  # noqa: E402
from cachegw.backend.core.async_engine import AsyncEngine  # noqa: E402
from cachegw.backend.core.engine import LLMEngine  # noqa: E402
from cachegw.backend.entrypoints.server import build_app as build_backend_app  # noqa: E402
from cachegw.gateway.upstream.proxy import Backends  # noqa: E402
from cachegw.policies.routing import PROMPT_PREFIX_CHARS, Router, rendezvous, routing_key  # noqa: E402
from testkit.servers import free_port, serve_in_thread  # noqa: E402
from tests.test_gateway import MODEL, SYSTEM, backend_url, gateway, settings_for  # noqa: E402,F401


def conversation(first: str, *later: str) -> list[list[dict]]:
    """The message lists a client sends turn by turn (assistant replies stubbed: only the prefix matters)."""
    turns, messages = [], [SYSTEM]
    for i, text in enumerate((first, *later)):
        if i:
            messages = [*messages, {"role": "assistant", "content": f"Answer {i}."}]
        messages = [*messages, {"role": "user", "content": text}]
        turns.append(messages)
    return turns


def ranked_first(urls: list[str], want: str, n: int, template: str) -> list[str]:
    """``n`` first questions (``template`` filled with a number) whose conversations rank ``want`` first.

    The test ports are random, so which backend a given question lands on is too; picking questions by
    the routing function itself makes the tests deterministic (and checks the gateway follows it: these
    plain messages are their own canonical form)."""
    out = []
    for i in range(1000):
        text = template.format(i)
        if rendezvous(urls, routing_key("chat", {"messages": conversation(text)[0]}))[0] == want:
            out.append(text)
            if len(out) == n:
                return out
    raise AssertionError(f"no {n} questions rank {want} first")  # 2**-1000-ish: the hash is broken


# The policy on its own


def test_turns_of_one_conversation_share_a_key_and_other_conversations_do_not() -> None:
    turns = conversation("Plan a trip to Rome.", "And to Milan?", "Which is cheaper?")
    keys = {routing_key("chat", {"messages": t}) for t in turns}
    assert len(keys) == 1
    other_question = routing_key("chat", {"messages": conversation("Plan a trip to Oslo.")[0]})
    other_system = routing_key(
        "chat", {"messages": [{"role": "system", "content": "Be terse."}, *turns[0][1:]]}
    )
    with_tools = routing_key("chat", {"messages": turns[0], "tools": [{"type": "function"}]})
    assert len({*keys, other_question, other_system, with_tools}) == 4


def test_the_volatile_note_of_the_first_turn_does_not_change_the_key() -> None:
    """Canonicalization appends a system prompt's timestamp to the LAST user message: on turn 1 that is
    the first user message, which later turns send without it. The key must not see the difference."""
    from cachegw.policies.canonicalize import canonicalize
    from cachegw.policies.canonicalize_config import CanonicalizeConfig

    system = {"role": "system", "content": "Now: 2026-11-22T10:03:17Z. You are a travel agent."}
    keys = []
    for turn in conversation("Plan a trip to Rome.", "And to Milan?"):
        body, fired = canonicalize({"messages": [system, *turn[1:]]}, CanonicalizeConfig(), lambda _: None)
        assert "volatile_to_tail" in fired
        keys.append(routing_key("chat", body))
    first_user = json.loads(keys[0])[1][-1]["content"]
    assert keys[0] == keys[1] and first_user == "Plan a trip to Rome."


def test_volatile_note_removal_on_each_content_shape() -> None:
    from cachegw.policies.canonicalize import without_volatile_note as strip

    note = "Context values: [volatile:1] = 2026-11-22"
    assert strip(f"Q?\n\n{note}") == "Q?"
    assert strip("Context values: none, user text") == "Context values: none, user text"  # not a note
    part = {"type": "text", "text": f"Q?\n\n{note}"}
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    assert strip([image, part]) == [image, {"type": "text", "text": "Q?"}]
    assert strip([part | {"text": "Q?"}, {"type": "text", "text": note}]) == [part | {"text": "Q?"}]
    assert strip(None) is None and strip([image]) == [image]


def test_completion_prompts_share_a_key_only_through_a_long_common_start() -> None:
    preamble = "x" * PROMPT_PREFIX_CHARS
    assert routing_key("completions", {"prompt": preamble + "A"}) == routing_key(
        "completions", {"prompt": preamble + "B"}
    )
    assert routing_key("completions", {"prompt": "short A"}) != routing_key(
        "completions", {"prompt": "short B"}
    )


def test_rendezvous_is_stable_even_and_moves_only_a_removed_backends_keys() -> None:
    urls = [f"http://10.0.0.{i}:8000/v1" for i in range(3)]
    keys = [f"conversation {i}" for i in range(3000)]
    first = {k: rendezvous(urls, k)[0] for k in keys}
    assert first == {
        k: rendezvous(list(reversed(urls)), k)[0] for k in keys
    }  # order of the list is irrelevant
    share = Counter(first.values())
    assert all(900 <= share[u] <= 1100 for u in urls), share  # 1000 expected each
    after = {k: rendezvous(urls[:2], k)[0] for k in keys}
    assert all(after[k] == first[k] for k in keys if first[k] != urls[2])  # the others' keys stay put


def test_round_robin_and_first_modes() -> None:
    urls, body = ["a", "b", "c"], {"messages": conversation("hi")[0]}
    rr = Router("round_robin")
    assert [rr.order(urls, "chat", body)[0] for _ in range(4)] == ["a", "b", "c", "a"]
    assert Router("first").order(urls, "chat", body) == urls
    assert Router("prefix").order(["only"], "chat", body) == ["only"]


def test_unknown_routing_mode_stops_the_start(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from cachegw.gateway.config import load_settings

    cfg = tmp_path / "c.toml"
    cfg.write_text('[gateway]\nrouting = "random"\n')
    with pytest.raises(ValidationError, match="routing"):
        load_settings(cfg)


# The real gateway in front of two real engines


def _engine() -> AsyncEngine:
    """A second engine next to the session's: short prompts only, so a small KV cache (90 MB, not 360)."""
    cfg = load_engine_config(
        None, device="cpu", dtype="float32", quantization="none", kv_cache_tokens=2048, max_num_seqs=8
    )
    return AsyncEngine(LLMEngine(cfg))


@pytest.fixture(scope="module")
def second_backend() -> Iterator[str]:
    engine = _engine()
    with serve_in_thread(build_backend_app(engine, MODEL, 1 << 20)) as url:
        yield f"{url}/v1"
    engine.shutdown()
    del engine
    gc.collect()


def logged(data_dir: Path, n: int) -> list[tuple[str, str, int, int]]:
    """(backend, cache result, prompt and cached tokens) of the requests, once the log holds ``n``."""
    deadline = time.monotonic() + 10
    query = "SELECT backend, cache_result, prompt_tokens, cached_tokens FROM requests ORDER BY ts"
    while True:
        with sqlite3.connect(data_dir / "cachegw.db") as db:
            rows = db.execute(query).fetchall()
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def send(url: str, messages: list[dict]) -> dict:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"authorization": "Bearer tenant-a", "cache-control": "no-cache"},
        json={"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 4},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def stream_text(url: str, messages: list[dict]) -> str:
    """A streamed chat completion through the gateway; the text, after checking the stream ended well."""
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        headers={"authorization": "Bearer tenant-a", "cache-control": "no-cache"},
        json={"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True},
        timeout=120,
    ) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])


def test_prefix_routing_keeps_conversations_on_the_backend_that_cached_them(
    backend_url: str,  # noqa: F811
    second_backend: str,
    tmp_path: Path,
) -> None:
    s = settings_for(tmp_path, [backend_url, second_backend])
    urls = [backend_url, second_backend]
    opening = "I am planning a long trip to destination number {} next spring with two children and a small "
    opening += "budget; which areas, museums, parks and day trips would you suggest, and in what order?"
    plan = [(b, text) for b in urls for text in ranked_first(urls, b, 2, opening)]
    with gateway(s) as url:
        for _, text in plan:
            for messages in conversation(text, "And after that?"):
                send(url, messages)
    sent = 2 * len(plan)
    rows = logged(tmp_path, sent)
    assert len(rows) == sent
    for (backend, _), first, second in zip(plan, rows[::2], rows[1::2], strict=True):
        assert first[0] == second[0] == backend  # both turns where the routing function says
        assert first[1] == second[1] == "bypass"
        # turn 2 found all of turn 1's full blocks cached, far more than the system prompt that every
        # backend has seen: only the backend that served turn 1 holds them
        blocks = first[2] // 16
        assert blocks >= 4 and second[3] >= 16 * blocks, (first, second)
    seen = {r[0] for r in rows}
    # the report's per-backend table counts the same requests (`cachegw analyze`, admin stats)
    from cachegw.gateway.offline.analyze_summary import build_summary
    from cachegw.gateway.storage.request_log import read_database

    summary = build_summary(read_database(f"sqlite:///{tmp_path / 'cachegw.db'}", None, None), s)
    per = summary["by_backend"]
    assert set(per) == seen and sum(g["requests"] for g in per.values()) == sent
    assert all(g["requests"] == sum(r[0] == b for r in rows) for b, g in per.items())
    assert all(g["prefix_cache_ratio"] > 0.3 for g in per.values())
    # latency over all it answered: these are bypasses, which a misses-only figure would leave empty
    assert all(g["answered_ms"]["n"] == g["requests"] and g["answered_ms"]["p50"] > 0 for g in per.values())


def test_a_backend_that_stops_answering_is_routed_around(backend_url: str, tmp_path: Path) -> None:  # noqa: F811
    """Discovered alive, then stopped: requests it would have taken go to the other backend, all 200."""
    engine = _engine()
    server = serve_in_thread(build_backend_app(engine, MODEL, 1 << 20))
    dying = f"{server.__enter__()}/v1"
    try:
        with gateway(settings_for(tmp_path, [backend_url, dying])) as url:
            models = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer k"}, timeout=30).json()
            assert [m["id"] for m in models["data"]] == [MODEL]  # one card, though two backends serve it
            server.__exit__(None, None, None)  # the backend goes away; the gateway keeps running
            urls = [backend_url, dying]
            template = "Question number {}: what is it squared?"
            first_dying, second_dying = ranked_first(urls, dying, 2, template)
            [normal] = ranked_first(urls, backend_url, 1, template)
            send(url, conversation(normal)[0])
            # the first-choice backend is gone: refused, the stream goes to the next one and ends well
            assert stream_text(url, conversation(first_dying)[0]).strip()
            admin = {"authorization": f"Bearer {(tmp_path / 'admin_token').read_text().strip()}"}
            health = httpx.get(f"{url}/health", headers=admin, timeout=30).json()  # tried last for 5 s
            assert health["backends_refusing"] == [dying]
            send(url, conversation(second_dying)[0])
            rows = logged(tmp_path, 3)
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        engine.shutdown()
    assert [r[0] for r in rows] == [backend_url] * 3
    # Prometheus: every request answered by the live one; refusals counted (one per 5 s pause at least)
    assert f'cachegw_gateway_backend_requests_total{{backend="{backend_url}"}} 3.0' in metrics
    refusals = f'cachegw_gateway_backend_refusals_total{{backend="{dying}"}} '
    assert refusals in metrics and float(metrics.split(refusals)[1].split()[0]) >= 1


def test_order_puts_a_refusing_backend_last_for_a_while() -> None:
    b = Backends(["http://a/v1", "http://b/v1"], 1.0, 1.0, "first")
    body = {"messages": conversation("hi")[0]}
    assert b.order(b.urls, "chat", body) == b.urls
    b._down_until["http://a/v1"] = time.monotonic() + 60
    assert b.order(b.urls, "chat", body) == ["http://b/v1", "http://a/v1"]
    b._down_until["http://a/v1"] = time.monotonic() - 1  # the pause is over: back in its place
    assert b.order(b.urls, "chat", body) == b.urls


def test_each_model_goes_only_to_the_backends_that_serve_it(backend_url: str, tmp_path: Path) -> None:  # noqa: F811
    """Two backends with different models: routing picks among a model's own backends, never across."""
    engine = _engine()
    try:
        with serve_in_thread(build_backend_app(engine, "other-model", 1 << 20)) as other:
            other_url = f"{other}/v1"
            with gateway(settings_for(tmp_path, [backend_url, other_url])) as url:
                listed = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer k"}, timeout=30)
                assert sorted(m["id"] for m in listed.json()["data"]) == sorted([MODEL, "other-model"])
                for i in range(4):
                    for model in (MODEL, "other-model"):
                        r = httpx.post(
                            f"{url}/v1/chat/completions",
                            headers={"authorization": "Bearer k", "cache-control": "no-cache"},
                            json={
                                "model": model,
                                "messages": conversation(f"Count to {i}.")[0],
                                "max_tokens": 2,
                            },
                            timeout=120,
                        )
                        assert r.status_code == 200 and r.json()["model"] == model
                rows = logged(tmp_path, 8)
    finally:
        engine.shutdown()
    assert Counter(r[0] for r in rows) == {backend_url: 4, other_url: 4}


def test_a_backend_down_at_start_gets_traffic_once_it_is_up(
    backend_url: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cachegw.gateway.compose as serve_module

    monkeypatch.setattr(serve_module, "DISCOVER_EVERY_S", 0.3)
    engine = _engine()
    port = free_port()
    late = f"http://127.0.0.1:{port}/v1"
    try:
        with gateway(settings_for(tmp_path, [backend_url, late])) as url:
            send(url, conversation("Before the second backend is up?")[0])  # nothing listens on it yet
            with serve_in_thread(build_backend_app(engine, MODEL, 1 << 20), port=port):
                time.sleep(1.0)  # a few discovery rounds
                [text] = ranked_first([backend_url, late], late, 1, "After it is up, question {}?")
                send(url, conversation(text)[0])
                sent = 2
                rows = logged(tmp_path, sent)
    finally:
        engine.shutdown()
    assert rows[0][0] == backend_url and rows[-1][0] == late


def test_a_prompt_cache_key_routes_every_conversation_that_gives_it_to_one_backend() -> None:
    urls = [f"http://b{i}:8000/v1" for i in range(8)]
    router = Router("prefix")
    system = {"role": "system", "content": "You are a support agent for ACME."}
    firsts = [
        router.order(urls, "chat", {"messages": [system, {"role": "user", "content": q}]})[0]
        for q in "abcdefgh"
    ]
    assert len(set(firsts)) > 1  # without a key, different first questions spread
    keyed = [
        router.order(
            urls, "chat", {"messages": [system, {"role": "user", "content": q}], "prompt_cache_key": "acme"}
        )[0]
        for q in "abcdefgh"
    ]
    assert len(set(keyed)) == 1
    other = {"messages": [system, {"role": "user", "content": "a"}], "prompt_cache_key": "globex"}
    assert routing_key("chat", other) != routing_key("chat", {**other, "prompt_cache_key": "acme"})
