"""Upstream credentials: each backend gets its own key (and headers) from `[gateway] backends`, on every
request including model listing and health probes; no backend ever sees a client's key or another
backend's key, and the keys appear in no log line, error or /health body.

The backends are small OpenAI-compatible test servers (testkit/servers.py ``recording_upstream``) because
the point is the headers they receive, which the built-in engine does not record. The gateway, its
SQLite store and the openai SDK are real."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import openai
import pytest

from cachegw.gateway.cli import main as cli_main
from cachegw.gateway.config import load_settings
from testkit.servers import Upstream, recording_upstream, serve_in_thread
from tests.test_gateway import gateway

CLIENT_KEY = "sk-client-must-not-travel"
KEY_A = "sk-upstream-a-7f3e"
KEY_B = "sk-upstream-b-91c2"


def _all_text(up: Upstream) -> str:
    return "\n".join(f"{h}\n{b.decode(errors='replace')}" for _, _, h, b in up.seen)


def test_each_backend_sees_its_own_key_never_the_clients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CACHEGW_TEST_KEY_B", KEY_B)
    a, b, plain = Upstream("model-a"), Upstream("model-b"), Upstream("model-c")
    caplog.set_level(logging.DEBUG)
    with (
        serve_in_thread(recording_upstream(a)) as url_a,
        serve_in_thread(recording_upstream(b)) as url_b,
        serve_in_thread(recording_upstream(plain)) as url_c,
    ):
        backends = (
            {"url": f"{url_a}/v1", "api_key": KEY_A, "headers": {"X-Org": "org-a"}},
            {"url": f"{url_b}/v1", "api_key_env": "CACHEGW_TEST_KEY_B"},
            f"{url_c}/v1",
        )
        settings = load_settings(None, data_dir=str(tmp_path), backends=backends)
        with gateway(settings) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=CLIENT_KEY, max_retries=0, timeout=60)
            assert sorted(m.id for m in client.models.list().data) == ["model-a", "model-b", "model-c"]
            for model, stream in [
                ("model-a", False),
                ("model-b", False),
                ("model-c", False),
                ("model-a", True),
            ]:
                messages = [{"role": "user", "content": f"Sky colour for {model} {stream}?"}]
                if stream:  # non-stream answer from the test server: forwarded as the backend sent it
                    r = httpx.post(
                        f"{url}/v1/chat/completions",
                        json={"model": model, "messages": messages, "temperature": 0, "stream": True},
                        headers={"authorization": f"Bearer {CLIENT_KEY}"},
                        timeout=60,
                    )
                    assert r.status_code == 200
                    continue
                reply = client.chat.completions.create(model=model, messages=messages, temperature=0)  # type: ignore[arg-type]
                assert reply.choices[0].message.content == "blue"
            admin = {"authorization": f"Bearer {(tmp_path / 'admin_token').read_text().strip()}"}
            health = httpx.get(f"{url}/health", headers=admin, timeout=30).text
    # every request each backend got carried its own key, listing, probes and completions alike
    for up, key in ((a, KEY_A), (b, KEY_B)):
        paths = {path for _, path, _, _ in up.seen}
        assert {"/v1/models", "/health", "/v1/chat/completions"} <= paths
        assert {h.get("authorization") for _, _, h, _ in up.seen} == {f"Bearer {key}"}
    assert {h.get("x-org") for _, _, h, _ in a.seen} == {"org-a"}
    assert all("authorization" not in h for _, _, h, _ in plain.seen)  # no key configured: none sent
    assert len(plain.requests("/v1/chat/completions")) == 1
    # no backend saw the client's key, nor another backend's key or headers
    assert CLIENT_KEY not in _all_text(a) + _all_text(b) + _all_text(plain)
    assert KEY_B not in _all_text(a) and KEY_A not in _all_text(b)
    assert KEY_A not in _all_text(plain) and KEY_B not in _all_text(plain)
    assert all("x-org" not in h for _, _, h, _ in b.seen + plain.seen)
    # and the secrets never left the gateway any other way
    assert KEY_A not in health and KEY_B not in health and url_a in health
    assert not any(KEY_A in r.getMessage() or KEY_B in r.getMessage() for r in caplog.records)
    assert KEY_A not in repr(settings) and KEY_A not in str(settings.gateway.backends)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('{ url = "http://127.0.0.1:9/v1", api_key = "sk-secret-1", token = "x" }', "token"),
        (
            '{ url = "http://127.0.0.1:9/v1", api_key = "sk-secret-1", api_key_env = "HOME" }',
            "api_key or api_key_env, not both",
        ),
        (
            '{ url = "http://127.0.0.1:9/v1", api_key_env = "CACHEGW_TEST_UNSET_VAR" }',
            "CACHEGW_TEST_UNSET_VAR",
        ),
        ('{ url = "127.0.0.1:9/v1", api_key = "sk-secret-1" }', "http://"),
        (
            '{ url = "http://127.0.0.1:9/v1", api_key = "sk-secret-1", headers = { Authorization = "x" } }',
            "Authorization",
        ),
        ('"http://127.0.0.1:9/v1", { url = "http://127.0.0.1:9/v1/" }', "listed twice"),
    ],
    ids=["unknown-key", "key-and-env", "env-missing", "not-a-url", "key-and-auth-header", "duplicate"],
)
def test_bad_backend_entries_stop_the_start_with_a_clear_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    entry: str,
    message: str,
) -> None:
    """Checked by `cachegw serve` before anything starts; the error names the problem, never the key."""
    monkeypatch.delenv("CACHEGW_TEST_UNSET", raising=False)
    config = tmp_path / "bad.toml"
    config.write_text(f"[gateway]\nbackends = [{entry}]\nport = 0\n")
    assert cli_main(["serve", "--config", str(config), "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "sk-secret-1" not in err
