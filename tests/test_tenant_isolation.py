"""Tenants never share the backend's prefix cache: cached_tokens must not reveal another tenant's prompt.

The real gateway in front of the real engine (the session's shared backend). Each test uses a system
prompt with a fresh secret, so no other test can have warmed its prefix.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from testkit.servers import serve_in_thread
from tests.test_gateway import ask, backend_url, chat, gateway, settings_for  # noqa: F401


def secret_system() -> dict:
    words = " ".join(f"rule{i} applies" for i in range(40))
    return {"role": "system", "content": f"The vault code is {uuid.uuid4().hex}. Never tell it. {words}."}


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def shared(usage: dict) -> int:
    """The cached tokens a next prompt that differs only in its question must get: the prompt less
    the question (20 tokens, give or take), in whole KV blocks of 16 (the engine's `block_size`),
    since the prefix cache reuses only full blocks (the vault code's length varies the alignment)."""
    return (usage["prompt_tokens"] - 20) // 16 * 16


def isolated(data_dir: Path, backend: str, on: bool):
    s = settings_for(data_dir, [backend])
    return s.model_copy(update={"tenants": s.tenants.model_copy(update={"prefix_isolation": on})})


@pytest.fixture(scope="module")
def gw(backend_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # noqa: F811
    with gateway(isolated(tmp_path_factory.mktemp("iso"), backend_url, True)) as url:
        yield url


def test_another_tenant_cannot_see_a_tenants_prefix_but_the_tenant_itself_reuses_it(gw: str) -> None:
    system = secret_system()
    _, _, first = chat(gw, ask("What is two plus two?", system), key="tenant-a")
    _, _, guess = chat(gw, ask("What is three plus three?", system), key="tenant-b")
    _, _, again = chat(gw, ask("What is four plus four?", system), key="tenant-a")
    assert cached(guess) == 0  # a right guess of A's whole system prompt earns B nothing
    assert cached(again) >= shared(first) > 0  # A's own next turn reuses it


def test_without_isolation_the_side_channel_is_open(backend_url: str, tmp_path: Path) -> None:  # noqa: F811
    """The test above can fail: with prefix_isolation off, B's guess is served from A's prefix."""
    system = secret_system()
    with gateway(isolated(tmp_path, backend_url, False)) as url:
        _, _, first = chat(url, ask("What is two plus two?", system), key="tenant-a")
        _, _, guess = chat(url, ask("What is three plus three?", system), key="tenant-b")
    assert cached(guess) >= shared(first) > 0


def test_a_clients_own_salt_combines_with_the_tenants(gw: str) -> None:
    system = secret_system()
    _, _, x1 = chat(gw, ask("Name a color.", system), key="tenant-a", extra_body={"cache_salt": "x"})
    _, _, y = chat(gw, ask("Name a fruit.", system), key="tenant-a", extra_body={"cache_salt": "y"})
    _, _, x2 = chat(gw, ask("Name a tree.", system), key="tenant-a", extra_body={"cache_salt": "x"})
    _, _, other = chat(gw, ask("Name a bird.", system), key="tenant-b", extra_body={"cache_salt": "x"})
    assert cached(y) == 0 and cached(other) == 0  # another salt, or the same salt of another tenant
    assert cached(x2) >= shared(x1) > 0


def salt_refusing_backend(seen: list[dict]) -> FastAPI:
    """A test server standing in for a backend that rejects unknown fields such as cache_salt (the
    built-in engine takes it, so it cannot show this)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "strict", "object": "model", "owned_by": "test"}]}

    @app.post("/v1/chat/completions")
    async def chat_route(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append(body)
        if "cache_salt" in body:
            error = {
                "message": "Unrecognized request argument supplied: cache_salt",
                "type": "invalid_request_error",
            }
            return JSONResponse({"error": {**error, "param": "cache_salt", "code": None}}, status_code=400)
        return JSONResponse(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": "strict",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
            }
        )

    return app


def test_a_backend_that_refuses_cache_salt_is_detected_once(tmp_path: Path) -> None:
    seen: list[dict] = []
    with serve_in_thread(salt_refusing_backend(seen)) as backend:
        with gateway(isolated(tmp_path, f"{backend}/v1", True)) as url:
            for question in ("one", "two"):
                r = httpx.post(
                    f"{url}/v1/chat/completions",
                    headers={"authorization": "Bearer k", "cache-control": "no-store"},
                    json={
                        "model": "strict",
                        "messages": [{"role": "user", "content": question}],
                        "temperature": 0,
                    },
                    timeout=60,
                )
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    assert ["cache_salt" in b for b in seen] == [True, False, False]  # refused once, then never sent


def test_tenants_in_one_prefix_group_share_the_prefix_cache_and_no_one_else(
    backend_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """[tenants] prefix_groups: the operator lets A and B share a system prompt's prefix; C stays apart,
    and the group shares no cached answers."""
    from cachegw.gateway.request.tenants import key_hash

    s = isolated(tmp_path, backend_url, True)
    groups = {"team": [key_hash("tenant-a"), key_hash("tenant-b")]}
    s = s.model_copy(update={"tenants": s.tenants.model_copy(update={"prefix_groups": groups})})
    system = secret_system()
    with gateway(s) as url:
        _, _, first = chat(url, ask("What is two plus two?", system), key="tenant-a")
        _, h, mate = chat(url, ask("What is two plus two?", system), key="tenant-b")
        _, _, outsider = chat(url, ask("What is five plus five?", system), key="tenant-c")
    assert h["x-cache"] == "miss"  # the same question from B: its own answer, not A's
    assert cached(mate) >= first["prompt_tokens"] - 20
    assert cached(outsider) == 0


def test_a_tenant_in_two_prefix_groups_is_refused_at_start() -> None:
    from pydantic import ValidationError

    from cachegw.gateway.config import TenantsConfig

    with pytest.raises(ValidationError, match="two prefix groups"):
        TenantsConfig(mode="open", shared_cache=False, keys={}, prefix_groups={"x": ["a"], "y": ["a", "b"]})
