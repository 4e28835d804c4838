"""docs/config.md is generated from the schema (`make config-docs`): it must match, every key must have
its one-line description, and keys a user's file still names at their old place fail naming the new one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cachegw.gateway.cache_config import FLAT
from cachegw.gateway.config import MOVED, load_settings
from cachegw.gateway.offline.config_docs import reference

ROOT = Path(__file__).resolve().parents[1]


def test_docs_config_md_is_generated_from_the_schema() -> None:
    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert text == reference(), "docs/config.md is stale: run `make config-docs`"


def test_every_key_of_config_toml_is_documented() -> None:
    doc = reference()
    for section in (
        "[engine]",
        "[backend_server]",
        "[gateway]",
        "[cache]",
        "[cache.encoder]",
        "[cache.verifier]",
    ):
        assert f"## `{section}`" in doc
    for section in ("[cache.error_bound]", "[cache.audits]", "[canonicalize.learn]", "[pricing]", "[index]"):
        assert f"## `{section}`" in doc


@pytest.mark.parametrize(
    ("toml", "new_place"),
    [
        ("[gateway]\nbuiltin_backend_port = 9001\n", "[backend_server] port"),
        ('[gateway]\nbuiltin_backend_cpus = "all"\n', "[engine] cpus"),
        ("[cache]\nembed_threads = 2\n", "[cache.encoder] threads"),
        ("[cache]\nverifier = false\n", "[cache.verifier] enabled"),
        ("[cache]\naudit_fraction = 0.5\n", "[cache.audits] fraction"),
        ("[cache]\nmax_false_hit_rate = 0.02\n", "[cache.error_bound] max_false_hit_rate"),
    ],
)
def test_a_moved_key_names_its_new_place(tmp_path: Path, toml: str, new_place: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text(toml)
    with pytest.raises(ValueError, match="is now " + re.escape(new_place)):
        load_settings(config)


def test_the_new_places_load(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        "[backend_server]\nport = 9001\n[cache.encoder]\nthreads = 2\n[cache.verifier]\nenabled = false\n"
    )
    s = load_settings(config)
    assert (s.backend_server.port, s.cache.encoder.threads, s.cache.verifier.enabled) == (9001, 2, False)


def test_moved_cache_keys_and_the_run_time_names_agree() -> None:
    moved = {k.removeprefix("cache."): v for k, v in MOVED.items() if k.startswith("cache.")}
    for flat, (sub, field) in FLAT.items():  # verifier too: a table of that name is its new place
        assert moved[flat] == f"[cache.{sub}] {field}"
    assert set(moved) == set(FLAT)
