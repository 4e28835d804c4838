"""``POST /tokenize`` on the engine's server (vLLM's route, which ``routing = "kv"`` asks for a prompt's ids):
bad bodies get a 400 in OpenAI's error shape, never a 500, and good ones the ids a completion would use."""

from __future__ import annotations

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def root(shared_backend_url: str) -> str:
    """The server's root: ``/tokenize`` sits beside ``/v1``, as in vLLM."""
    return shared_backend_url.removesuffix("/v1")


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2, 3]",
        b'"a bare string"',
        b"{}",
        b'{"model": "SmolLM2-135M-Instruct", "messages": "not a list"}',
        b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "wizard", "content": "hi"}]}',
        b'{"model": "SmolLM2-135M-Instruct", "messages": [], "tools": [{"type": "function"}]}',
        b'{"model": "SmolLM2-135M-Instruct", "prompt": {"a": 1}}',
        b'{"model": "SmolLM2-135M-Instruct", "prompt": [1, "two"]}',
    ],
    ids=["json", "array", "string", "empty", "messages", "role", "tool", "prompt-object", "prompt-mixed"],
)
def test_bad_bodies_get_a_400_in_openais_error_shape(root: str, body: bytes) -> None:
    r = httpx.post(f"{root}/tokenize", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert set(error) >= {"message", "type", "param", "code"}


def test_an_unknown_model_is_a_404_in_openais_error_shape(root: str) -> None:
    r = httpx.post(f"{root}/tokenize", json={"model": "no-such-model", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["message"]


def test_a_completion_prompt_is_tokenized_as_the_completion_counts_it(root: str) -> None:
    prompt = "The library opens at nine."
    tok = httpx.post(f"{root}/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=30)
    assert tok.status_code == 200, tok.text
    done = httpx.post(
        f"{root}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0},
        timeout=60,
    ).json()
    assert tok.json()["count"] == len(tok.json()["tokens"]) == done["usage"]["prompt_tokens"]
