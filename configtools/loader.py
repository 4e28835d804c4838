"""config.toml read once: the packaged defaults, a user's file merged over them key by key, then the
``CACHEGW_<SECTION>__<KEY>`` environment variables (``configtools.env``) over both.

Both `cachegw serve` (the gateway's sections) and `cachegw backend` (the engine's) read it here, so
neither reaches into the other for loading. A key a user's file still names at its old place is an
error saying where it went (``moved_keys``), never silently ignored; each reader passes the table of
the keys it moved (``backend.config.MOVED``, ``gateway.cache_config.MOVED``).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from cachegw.configtools.env import apply_env

# The defaults' one source is config.toml at the repository root, where users read it. A wheel carries
# it as configtools/defaults.toml (copied by setup.py's build step); a source checkout reads the file.
PACKAGED_DEFAULTS = "defaults.toml"
SOURCE_CONFIG_PATH = Path(__file__).resolve().parent.parent / "config.toml"

# Keys that moved, as "section.key" (dotted sub-tables) -> their new place: what each reader passes.
Moved = Mapping[str, str]


def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base`` key by key, tables merged recursively."""
    out = dict(base)
    for key, value in over.items():
        out[key] = (
            merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def moved_keys(user: Mapping[str, Any], moved: Moved) -> list[str]:
    """Each key of a user's file that moved, with where it went. A key that became a table of its
    own name (``[cache] verifier`` -> ``[cache.verifier]``) has moved only when it is not a table."""
    found = []
    for old, new in moved.items():
        *tables, key = old.split(".")
        node: Any = user
        for t in tables:
            node = node.get(t) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping) or key not in node:
            continue
        if isinstance(node[key], Mapping) and new.startswith(f"[{old}]"):
            continue  # the new place itself
        found.append(f"[{'.'.join(tables)}] {key} is now {new}")
    return found


def defaults_text() -> str:
    """config.toml's text: the wheel's configtools/defaults.toml when installed, else the checkout's."""
    packaged = resources.files("cachegw.configtools").joinpath(PACKAGED_DEFAULTS)
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return SOURCE_CONFIG_PATH.read_text(encoding="utf-8")


def load_defaults() -> dict[str, Any]:
    """The packaged defaults alone (what docs/config.md documents)."""
    return tomllib.loads(defaults_text())


def load_toml(
    path: str | os.PathLike[str] | None = None,
    moved: Moved | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The packaged defaults, the user's file (if any) merged over them, then the ``CACHEGW_*__*``
    variables of ``environ`` (default: the process's). A key of ``moved`` is a ValueError naming its
    new place; a variable that names no key, a ValueError naming the variable."""
    defaults = data = load_defaults()
    if path is not None:
        with open(path, "rb") as f:
            user = tomllib.load(f)
        found = moved_keys(user, moved or {})
        if found:
            raise ValueError(f"config {os.fspath(path)}: moved keys: {'; '.join(found)}")
        data = merge(data, user)
    return apply_env(data, os.environ if environ is None else environ, defaults)
