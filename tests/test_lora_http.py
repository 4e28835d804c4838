"""LoRA adapters over HTTP: listed in /v1/models under their base, chosen by `model`, loaded and
unloaded at run time behind the admin guard; and through the gateway, whose cache never answers one
adapter (or the base) with another's stored answer.

The engine is the tiny random Llama of tests/test_lora.py (SmolLM2's tokenizer, so chat works) behind
its real HTTP server; the gateway is real too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from starlette.requests import Request

from cachegw.protocol.errors import ApiError
from testkit.servers import serve_in_thread
from tests.test_lora import models  # noqa: F401  (the fixture)

BASE = "tiny-base"


@pytest.fixture(scope="module")
def engine_url(models: dict[str, Path]) -> Iterator[str]:  # noqa: F811
    from cachegw.backend.config import load_engine_config
    from cachegw.backend.core.async_engine import AsyncEngine
    from cachegw.backend.core.engine import LLMEngine
    from cachegw.backend.entrypoints.server import build_app

    cfg = load_engine_config(
        None, model=str(models["base"]), device="cpu", dtype="float32", quantization="none",
        kv_cache_tokens=4096, max_num_seqs=8, max_loras=3, max_lora_rank=8,
        lora_modules={"alpha": str(models["alpha"]), "beta": str(models["beta"])},
    )  # fmt: skip
    engine = AsyncEngine(LLMEngine(cfg))
    try:
        with serve_in_thread(build_app(engine, BASE, 1 << 20)) as url:
            yield url
    finally:
        engine.shutdown()


def complete(url: str, model: str) -> openai.types.Completion:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    return c.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)


def test_models_lists_the_adapters_under_their_base(engine_url: str) -> None:
    cards = {c["id"]: c for c in httpx.get(f"{engine_url}/v1/models").json()["data"]}
    assert set(cards) == {BASE, "alpha", "beta"}
    assert cards["alpha"]["parent"] == cards["beta"]["parent"] == BASE
    assert httpx.get(f"{engine_url}/v1/models/beta").json()["parent"] == BASE


def test_a_request_runs_under_the_adapter_it_names(engine_url: str) -> None:
    texts = {m: complete(engine_url, m) for m in (BASE, "alpha", "beta")}
    assert {m: c.model for m, c in texts.items()} == {BASE: BASE, "alpha": "alpha", "beta": "beta"}
    assert len({c.choices[0].text for c in texts.values()}) == 3
    with pytest.raises(openai.NotFoundError) as err:
        complete(engine_url, "gamma")
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_load_and_unload_at_run_time(engine_url: str, models: dict[str, Path]) -> None:  # noqa: F811
    load, unload = f"{engine_url}/v1/load_lora_adapter", f"{engine_url}/v1/unload_lora_adapter"
    beta_text = complete(engine_url, "beta").choices[0].text
    assert httpx.post(load, json={"lora_name": "gamma", "lora_path": str(models["beta"])}).status_code == 200
    assert "gamma" in {c["id"] for c in httpx.get(f"{engine_url}/v1/models").json()["data"]}
    assert complete(engine_url, "gamma").choices[0].text == beta_text  # the same files, the same model
    bad = [
        ({"lora_name": "gamma", "lora_path": str(models["beta"])}, 400),  # loaded already
        ({"lora_name": "delta", "lora_path": "/nonexistent"}, 400),
        ({"lora_name": "delta"}, 400),
        ({"lora_name": "delta", "lora_path": str(models["alpha"])}, 409),  # 3 slots: alpha, beta, gamma
    ]
    for body, status in bad:
        r = httpx.post(load, json=body)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["message"]
    assert httpx.post(unload, json={"lora_name": "gamma"}).status_code == 200
    r = httpx.post(unload, json={"lora_name": "gamma"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        complete(engine_url, "gamma")
    # its slot is free again
    assert httpx.post(load, json={"lora_name": "delta", "lora_path": str(models["alpha"])}).status_code == 200
    assert httpx.post(unload, json={"lora_name": "delta"}).status_code == 200


def _request(host: str, authorization: str = "") -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    return Request({"type": "http", "client": (host, 5000), "headers": headers})


def test_the_admin_guard() -> None:
    from cachegw.backend.entrypoints.lora_routes import AdminGuard

    open_guard, token_guard = AdminGuard(""), AdminGuard("s3cret")
    open_guard.check(_request("127.0.0.1"))
    open_guard.check(_request("::1"))
    token_guard.check(_request("10.1.2.3", "Bearer s3cret"))
    for guard, request, status in [
        (open_guard, _request("10.1.2.3"), 403),
        (token_guard, _request("127.0.0.1"), 401),
        (token_guard, _request("127.0.0.1", "Bearer wrong"), 401),
    ]:
        with pytest.raises(ApiError) as err:
            guard.check(request)
        assert err.value.status == status


def test_the_gateway_never_serves_one_adapters_answer_to_another(
    engine_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.test_gateway import gateway, settings_for

    messages = [{"role": "user", "content": "Name a famous painting."}]
    paraphrase = [{"role": "user", "content": "Name one famous painting."}]
    with gateway(settings_for(tmp_path_factory.mktemp("lora-gw"), [f"{engine_url}/v1"])) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="tenant-a", max_retries=0, timeout=120)

        def ask(model: str, msgs: list[dict]) -> tuple[str, str]:
            raw = c.chat.completions.with_raw_response.create(
                model=model,
                messages=msgs,  # type: ignore[arg-type]
                temperature=0,
                max_tokens=8,
            )
            return raw.headers["x-cache"], raw.parse().choices[0].message.content or ""

        cache, alpha_text = ask("alpha", messages)
        assert cache == "miss"
        assert ask("alpha", messages) == ("exact-hit", alpha_text)
        assert ask("alpha", paraphrase) == ("semantic-hit", alpha_text)  # the semantic tier serves it...
        for other in ("beta", BASE):  # ...but under another model neither tier answers with alpha's
            cache, own = ask(other, paraphrase)
            assert cache == "miss", other
            cache, text = ask(other, messages)  # no exact entry; the nearest is its own paraphrase's
            assert cache in ("miss", "semantic-hit") and (cache == "miss" or text == own), other


def test_streams_run_under_the_adapter_they_name(engine_url: str) -> None:
    """The SDK's streams (chat and completions) name an adapter as ``model``: every chunk carries that
    name and the streamed text is the adapter's own (its non-streamed answer, and not the base's)."""
    c = openai.OpenAI(base_url=f"{engine_url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Name a famous painting."}]
    texts: dict[str, tuple[str, str]] = {}
    for model in ("alpha", "beta", BASE):
        pieces, names = [], set()
        for chunk in c.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        ):
            names.add(chunk.model)
            pieces += [choice.text for choice in chunk.choices]
        assert names == {model}
        assert "".join(pieces) == complete(engine_url, model).choices[0].text
        chat, names = [], set()
        stream = c.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            names.add(chunk.model)
            chat += [choice.delta.content or "" for choice in chunk.choices]
            if chunk.usage is not None:
                assert chunk.usage.completion_tokens == 8
        assert names == {model}
        whole = c.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
        )
        assert "".join(chat) == whole.choices[0].message.content
        texts[model] = ("".join(pieces), "".join(chat))
    assert len(set(texts.values())) == 3, texts  # each adapter (and the base) answers its own way
    with pytest.raises(openai.NotFoundError):  # an unknown adapter fails before any event is sent
        for _ in c.chat.completions.create(model="gamma", messages=messages, stream=True):  # type: ignore[arg-type]
            pass
