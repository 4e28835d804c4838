"""Config keys from the environment (``CACHEGW_<SECTION>__<KEY>``): parsed as TOML, laid over the file
before validation, secrets from ``_FILE``s, and a variable that names no key refused by name."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from cachegw.backend.config import load_backend_server_config, load_engine_config
from cachegw.configtools.env import apply_env, is_override, parse_value
from cachegw.configtools.loader import SOURCE_CONFIG_PATH, defaults_text, load_toml
from cachegw.gateway.config import load_settings

ROOT = Path(__file__).resolve().parents[1]


def test_the_defaults_are_config_toml() -> None:
    """A source checkout reads config.toml itself: a stray configtools/defaults.toml would shadow it."""
    assert defaults_text() == SOURCE_CONFIG_PATH.read_text(encoding="utf-8")


def test_only_names_with_a_double_underscore_are_config_keys() -> None:
    assert is_override("CACHEGW_GATEWAY__PORT")
    for name in ("CACHEGW_CACHE_DIR", "CACHEGW_ADMIN_TOKEN", "CACHEGW_REQUIRE_POSTGRES", "OTHER__PORT"):
        assert not is_override(name)
    # those keep their meaning and stop nothing: loading with them set works
    assert load_toml(environ={"CACHEGW_CACHE_DIR": "/tmp/x", "CACHEGW_LOG_LEVEL": "DEBUG"})


@pytest.mark.parametrize(
    ("text", "current", "value"),
    [
        ("8100", 8000, 8100),
        ("2.5", 1.0, 2.5),
        ("false", True, False),
        ('["http://x/v1", { url = "http://y/v1", drafts = true }]', [], None),
        ("0.0.0.0", "127.0.0.1", "0.0.0.0"),
        ("123", "model", "123"),  # a string key keeps the text, even when it reads as a number
        ('"quoted"', 1, "quoted"),
        ("not toml", 1, "not toml"),  # left to the validation, which names the key
    ],
)
def test_values_read_as_toml(text: str, current: object, value: object) -> None:
    got = parse_value(text, current)
    if value is None:
        assert got == ["http://x/v1", {"url": "http://y/v1", "drafts": True}]
    else:
        assert got == value and type(got) is type(value)


def test_overrides_reach_the_typed_settings_of_both_commands(tmp_path: Path, monkeypatch) -> None:
    user = tmp_path / "user.toml"
    user.write_text('[gateway]\nport = 9000\nrouting = "first"\n[engine]\nmax_num_seqs = 3\n')
    env = {
        "CACHEGW_GATEWAY__PORT": "8100",  # over the user's file
        "CACHEGW_GATEWAY__BACKENDS": '["http://gpu1:8000/v1"]',
        "CACHEGW_CACHE__ENCODER__THREADS": "3",  # a sub-table
        "CACHEGW_TENANTS__KEYS__ALICE": "sk-alice",  # a new entry of a table left empty for the user
        "CACHEGW_BACKEND_SERVER__PORT": "8102",  # a section whose name has an underscore
        "CACHEGW_ENGINE__KV_CACHE_TOKENS": "4096",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    s = load_settings(user)
    assert (s.gateway.port, s.gateway.routing) == (8100, "first")
    assert [b.url if hasattr(b, "url") else b for b in s.gateway.backends] == ["http://gpu1:8000/v1"]
    assert s.cache.encoder.threads == 3
    assert dict(s.tenants.keys) == {"alice": "sk-alice"}
    assert load_settings(user, port=8200).gateway.port == 8200  # the command line wins over both
    assert load_backend_server_config(None).port == 8102
    engine = load_engine_config(str(user))
    assert (engine.kv_cache_tokens, engine.max_num_seqs) == (4096, 3)


def test_a_secret_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cret-token\n")
    data = load_toml(environ={"CACHEGW_ADMIN__TOKEN_FILE": str(secret)})
    assert data["admin"]["token"] == "s3cret-token"
    keys = load_toml(environ={"CACHEGW_TENANTS__KEYS__BOB_FILE": str(secret)})["tenants"]["keys"]
    assert keys == {"bob": "s3cret-token"}
    with pytest.raises(ValueError, match=r"CACHEGW_ADMIN__TOKEN_FILE: cannot read .*missing"):
        load_toml(environ={"CACHEGW_ADMIN__TOKEN_FILE": str(tmp_path / "missing")})


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("CACHEGW_GATEWAY__PROT", r"\[gateway\] prot"),
        ("CACHEGW_GATEWY__PORT", r"\[gatewy\] port"),
        ("CACHEGW_CACHE__ENCODER__THREDS", r"\[cache.encoder\] threds"),
        ("CACHEGW_GATEWAY__PORT__X", r"\[gateway.port\] x"),  # no table under a value
        ("CACHEGW_GATEWAY___PORT", r"\[gateway\] _port"),
        ("CACHEGW_GATEWAY__PROT_FILE", r"\[gateway\] prot_file"),
        ("CACHEGW_CACHE__NEW__KEY", r"\[cache.new\] key"),  # only tables empty in the defaults take new keys
    ],
)
def test_a_variable_that_names_no_key_is_an_error_naming_it(name: str, key: str) -> None:
    with pytest.raises(ValueError, match=rf"environment variable {name}: no config key {key}"):
        load_toml(environ={name: "1"})


def test_a_bad_value_is_refused_by_the_validation(monkeypatch) -> None:
    monkeypatch.setenv("CACHEGW_GATEWAY__PORT", "eighty")
    with pytest.raises(ValueError, match="port"):
        load_settings(None)
    monkeypatch.setenv("CACHEGW_GATEWAY__PORT", "8000")
    monkeypatch.setenv("CACHEGW_ENGINE__DTYPE", "f8")
    with pytest.raises(ValueError, match="dtype='f8'"):
        load_engine_config(None)


def test_apply_env_leaves_its_input_alone() -> None:
    data = {"gateway": {"port": 8000}}
    assert apply_env(data, {"CACHEGW_GATEWAY__PORT": "1"}) == {"gateway": {"port": 1}}
    assert data == {"gateway": {"port": 8000}}


@pytest.mark.slow
def test_serve_listens_on_the_port_the_environment_names(shared_backend_url: str, tmp_path: Path) -> None:
    """`cachegw serve` with no --port and no file: the port is CACHEGW_GATEWAY__PORT's alone."""
    from testkit.servers import free_port
    from tests.test_gateway_process import stop, wait_health
    from tests.test_wheel import serve_env, start

    port = free_port()
    env = serve_env(tmp_path, port, shared_backend_url)
    # run from the checkout, so `gateway` is this tree's (as every test's own process)
    proc = start([sys.executable, "-m", "cachegw.gateway.cli", "serve"], env, ROOT, tmp_path / "serve.log")
    try:
        wait_health(port, proc)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": "Bearer k"})
        assert models.status_code == 200
    finally:
        stop(proc)
