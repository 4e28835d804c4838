"""POST /v1/embeddings: the engine's endpoint on the real SmolLM2, and the gateway's exact cache per input
in front of it, through the real openai SDK and LiteLLM.

What the backend computed is read from its own counter (``cachegw:embedding_inputs_total`` on the
engine's /metrics), so "only the new inputs went upstream" is what the engine saw, not what the gateway
says it sent.
"""

from __future__ import annotations

import base64
import os
import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tests.test_gateway import MODEL, client, gateway, settings_for  # noqa: E402

CAT = "The cat sat on the mat."
CAT_AGAIN = "A cat was sitting on the mat."
REVENUE = "Quarterly revenue grew by twelve percent."


def embed(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{url}/embeddings", json=body, headers=headers, timeout=120)


def vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float64)


def backend_inputs(backend: str) -> float:
    """Inputs the engine has embedded so far (its Prometheus counter)."""
    text = httpx.get(backend.removesuffix("/v1") + "/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("cachegw:embedding_inputs_total"))
    return float(line.split()[-1])


@pytest.fixture(scope="module")
def backend(shared_backend_url: str) -> str:
    """The session's engine behind its OpenAI server (tests/conftest.py), ending in /v1."""
    return shared_backend_url


@pytest.fixture(scope="module")
def hidden_size(shared_engine: Any) -> int:
    return shared_engine.engine.runner.spec.hidden_size


# --- the engine's endpoint ---------------------------------------------------------------------------


def test_each_input_gets_a_unit_vector_of_the_hidden_size_in_order(backend: str, hidden_size: int) -> None:
    r = embed(backend, {"input": [CAT, "x", REVENUE], "model": MODEL})
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert {d["object"] for d in body["data"]} == {"embedding"}
    e = vectors(r)
    assert e.shape == (3, hidden_size)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 3
    one = vectors(embed(backend, {"input": REVENUE}))  # alone, the same vector as in a batch (to rounding)
    assert one[0] @ e[2] > 0.9999


def test_similar_sentences_score_higher_than_unrelated_ones(backend: str) -> None:
    cat, again, revenue = vectors(embed(backend, {"input": [CAT, CAT_AGAIN, REVENUE]}))
    assert cat @ again > cat @ revenue + 0.1
    assert cat @ again > again @ revenue + 0.1


def test_base64_is_the_float_list_as_little_endian_float32(backend: str) -> None:
    floats = embed(backend, {"input": [CAT, REVENUE]}).json()["data"]
    packed = embed(backend, {"input": [CAT, REVENUE], "encoding_format": "base64"}).json()["data"]
    for f, b in zip(floats, packed, strict=True):
        assert isinstance(b["embedding"], str)
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert np.array_equal(decoded, np.array(f["embedding"], dtype=np.float32))


def test_token_ids_embed_as_their_text_does(backend: str, smol_tokenizer: Any) -> None:
    ids = smol_tokenizer.encode(CAT, add_special_tokens=False)
    text = embed(backend, {"input": CAT})
    one = embed(backend, {"input": ids})
    several = embed(backend, {"input": [ids, ids[:3]]})
    assert one.json()["usage"]["prompt_tokens"] == len(ids) == text.json()["usage"]["prompt_tokens"]
    np.testing.assert_allclose(vectors(one)[0], vectors(text)[0], atol=1e-5)
    # in a batch of another shape the int4 kernels round differently: the same vector, to rounding
    assert vectors(several)[0] @ vectors(text)[0] > 0.9999
    assert several.json()["usage"]["prompt_tokens"] == len(ids) + 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["fine", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, -2]}, "input"),
        ({"input": [1, True]}, "input"),
        ({"input": ["text", [1, 2]]}, "input"),
        ({"input": {"text": "x"}}, "input"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": [10**9]}, "input"),  # beyond the vocabulary
        ({"model": MODEL}, "input"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "dimensions": 3}, "dimensions"),
        ({"input": "x", "dimensions": "576"}, "dimensions"),
    ],
)
def test_bad_input_is_a_400_in_openais_shape(backend: str, body: dict, param: str) -> None:
    r = embed(backend, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_an_input_past_the_context_is_refused_naming_input(backend: str, shared_engine: Any) -> None:
    limit = shared_engine.max_model_len
    r = embed(backend, {"input": [[5, 6], [7] * (limit + 1)]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "input" and error["code"] == "context_length_exceeded"
    assert "input[1]" in error["message"] and str(limit) in error["message"]
    assert embed(backend, {"input": "x", "model": "other"}).status_code == 404


def test_embeddings_between_steps_leave_running_generations_unchanged(backend: str) -> None:
    """The forward writes its keys and values into a scratch cache, never into the blocks a running
    request holds: a greedy completion decoded while embeddings run is the same text as alone."""
    body = {"model": MODEL, "prompt": "The three primary colours are", "max_tokens": 40, "temperature": 0}

    def complete() -> str:
        r = httpx.post(f"{backend}/completions", json=body, timeout=120)
        return r.json()["choices"][0]["text"]

    alone = complete()
    texts: list[str] = []
    worker = threading.Thread(target=lambda: texts.append(complete()))
    worker.start()
    long = " ".join([CAT, CAT_AGAIN, REVENUE] * 20)
    while worker.is_alive():
        assert embed(backend, {"input": [long, REVENUE]}).status_code == 200
    worker.join()
    assert texts == [alone]


def test_the_vector_is_the_mean_of_hugging_faces_last_hidden_state(llm: Any, hf_model: Any) -> None:
    """The pooling docs/engine.md states: hidden states after the final norm, averaged, unit length."""
    from cachegw.backend.executor.embedding_forward import MeanPooledEmbedder

    inputs = [[1, 2, 3, 4, 5, 6, 7], [42], list(range(100, 140))]
    ours = MeanPooledEmbedder(llm.engine.runner).embed(inputs)
    with torch.inference_mode():
        for ids, got in zip(inputs, ours, strict=True):
            hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0].float()
            want = torch.nn.functional.normalize(hidden.mean(0), dim=0)
            torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


# --- through the gateway -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gw(backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with gateway(settings_for(tmp_path_factory.mktemp("gw-embeddings"), [backend])) as url:
        yield url


def sdk_embed(url: str, texts: list[str], key: str = "tenant-a", **kw: Any) -> tuple[list[list[float]], Any]:
    raw = client(url, key).embeddings.with_raw_response.create(model=MODEL, input=texts, **kw)
    parsed = raw.parse()
    return [d.embedding for d in sorted(parsed.data, key=lambda d: d.index)], raw


def test_a_repeat_is_an_exact_hit_without_the_backend(gw: str, backend: str) -> None:
    texts = ["gw miss then hit one", "gw miss then hit two"]
    first, raw = sdk_embed(gw, texts)
    assert raw.headers["x-cache"] == "miss" and raw.headers["x-cache-hits"] == "0/2"
    assert raw.headers["x-request-id"].startswith("req-")
    assert raw.parse().usage.prompt_tokens > 0
    before = backend_inputs(backend)
    again, raw = sdk_embed(gw, texts)
    assert raw.headers["x-cache"] == "exact-hit" and raw.headers["x-cache-hits"] == "2/2"
    assert backend_inputs(backend) == before
    assert again == first
    usage = raw.parse().usage
    assert usage.prompt_tokens == 0 and usage.total_tokens == 0  # nothing was computed for it
    assert raw.parse().model == MODEL
    direct = vectors(embed(backend, {"input": texts}))
    np.testing.assert_allclose(np.array(again), direct, atol=1e-6)


def test_a_batch_with_repeats_sends_only_the_new_inputs_upstream(gw: str, backend: str) -> None:
    seen = ["batch seen alpha", "batch seen beta"]
    cached, _ = sdk_embed(gw, seen)
    before = backend_inputs(backend)
    batch = ["batch new gamma", seen[0], "batch new delta", "batch new gamma", seen[1]]
    got, raw = sdk_embed(gw, batch)
    assert backend_inputs(backend) - before == 2  # gamma once, delta: the rest came from the cache
    assert raw.headers["x-cache"] == "miss" and raw.headers["x-cache-hits"] == "2/5"
    assert got[1] == cached[0] and got[4] == cached[1] and got[0] == got[3]
    fresh = vectors(embed(backend, {"input": ["batch new gamma", "batch new delta"]}))
    np.testing.assert_allclose(np.array([got[0], got[2]]), fresh, atol=1e-6)
    # usage: only the two inputs the backend embedded
    computed = embed(backend, {"input": ["batch new gamma", "batch new delta"]}).json()["usage"]
    assert raw.parse().usage.prompt_tokens == computed["prompt_tokens"]


def test_floats_and_base64_are_cached_apart_and_both_decode_alike(gw: str) -> None:
    text = "format apart"
    auth = {"authorization": "Bearer k"}
    floats = httpx.post(f"{gw}/v1/embeddings", json={"input": [text], "model": MODEL}, headers=auth)
    packed, raw = sdk_embed(gw, [text], key="k")  # the SDK asks for base64 and decodes it
    assert floats.headers["x-cache"] == "miss" and raw.headers["x-cache"] == "miss"
    np.testing.assert_allclose(floats.json()["data"][0]["embedding"], packed[0], atol=1e-7)
    again = httpx.post(f"{gw}/v1/embeddings", json={"input": text, "model": MODEL}, headers=auth)
    assert again.headers["x-cache"] == "exact-hit"
    assert again.json()["data"][0]["embedding"] == floats.json()["data"][0]["embedding"]


def test_a_tenants_cached_embedding_is_no_hit_for_another_tenant(gw: str) -> None:
    text = ["tenant private sentence"]
    sdk_embed(gw, text, key="tenant-a")
    _, raw = sdk_embed(gw, text, key="tenant-b")
    assert raw.headers["x-cache"] == "miss" and raw.headers["x-cache-hits"] == "0/1"
    _, raw = sdk_embed(gw, text, key="tenant-a")
    assert raw.headers["x-cache"] == "exact-hit"


def test_shared_cache_lets_tenants_share_embeddings(
    backend: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    s = settings_for(tmp_path_factory.mktemp("gw-embeddings-shared"), [backend])
    s = s.model_copy(update={"tenants": s.tenants.model_copy(update={"shared_cache": True})})
    with gateway(s) as url:
        sdk_embed(url, ["shared sentence"], key="tenant-a")
        _, raw = sdk_embed(url, ["shared sentence"], key="tenant-b")
        assert raw.headers["x-cache"] == "exact-hit"


def test_cache_control_is_honoured(gw: str, backend: str) -> None:
    text = ["cache control sentence"]
    _, raw = sdk_embed(gw, text, extra_headers={"Cache-Control": "no-store"})
    assert raw.headers["x-cache"] == "bypass" and raw.headers["x-cache-reason"] == "no-store"
    _, raw = sdk_embed(gw, text)  # no-store kept nothing
    assert raw.headers["x-cache"] == "miss"
    before = backend_inputs(backend)
    _, raw = sdk_embed(gw, text, extra_headers={"Cache-Control": "no-cache"})
    assert raw.headers["x-cache"] == "bypass" and backend_inputs(backend) - before == 1
    _, raw = sdk_embed(gw, text)
    assert raw.headers["x-cache"] == "exact-hit"


def test_errors_are_openai_shaped(gw: str) -> None:
    sdk = client(gw)
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.embeddings.create(model=MODEL, input="")
    assert bad.value.status_code == 400 and bad.value.body["param"] == "input"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.embeddings.create(model=MODEL, input=["ok", [1, 2]])  # type: ignore[list-item]
    assert bad.value.body["param"] == "input"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.embeddings.create(model="no-such-model", input="x")
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:  # the backend's own refusal, passed through
        sdk.embeddings.create(model=MODEL, input="x", dimensions=3)
    assert bad.value.body["param"] == "dimensions"  # type: ignore[index]
    r = httpx.post(f"{gw}/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_each_request_is_one_log_record_counted_by_api(gw: str) -> None:
    sdk_embed(gw, ["metrics one", "metrics two"])
    sdk_embed(gw, ["metrics one", "metrics two"])
    text = httpx.get(f"{gw}/metrics").text
    lines = [ln for ln in text.splitlines() if ln.startswith("cachegw_gateway_api_requests_total{")]
    assert any('api="embeddings"' in ln and 'result="exact-hit"' in ln for ln in lines)
    assert any('api="embeddings"' in ln and 'result="miss"' in ln for ln in lines)


def test_the_request_log_keeps_one_row_per_request(
    backend: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    data_dir = tmp_path_factory.mktemp("gw-embeddings-log")
    with gateway(settings_for(data_dir, [backend])) as url:  # the log is flushed when it stops
        sdk_embed(url, ["log a", "log b", "log a"])
        sdk_embed(url, ["log a"])
    with sqlite3.connect(data_dir / "cachegw.db") as db:
        rows = db.execute("SELECT api, endpoint, cache_result, prompt_tokens FROM requests").fetchall()
    assert [r[:3] for r in rows] == [
        ("embeddings", "embeddings", "miss"),
        ("embeddings", "embeddings", "exact-hit"),
    ]
    assert rows[0][3] > 0 and rows[1][3] == 0


def test_litellm_as_a_client(gw: str) -> None:
    import litellm

    out = litellm.embedding(
        model=f"openai/{MODEL}", api_base=f"{gw}/v1", api_key="tenant-litellm", input=["litellm one", "two"]
    )
    assert len(out.data) == 2
    first = out.data[0]["embedding"]
    assert len(first) == 576 and abs(float(np.linalg.norm(first)) - 1.0) < 1e-4
    again = litellm.embedding(
        model=f"openai/{MODEL}", api_base=f"{gw}/v1", api_key="tenant-litellm", input=["litellm one", "two"]
    )
    assert again.data[0]["embedding"] == first
