"""Config keys from the environment: ``CACHEGW_<SECTION>__<KEY>`` over the file, before validation.

A container or a systemd unit sets a key without writing a file: ``CACHEGW_GATEWAY__PORT=8100``,
``CACHEGW_CACHE__ENCODER__THREADS=2`` (``__`` separates tables), values read as TOML
(``CACHEGW_GATEWAY__BACKENDS='["http://gpu1:8000/v1"]'``), a bare word as a string. A secret can come
from a file instead (``CACHEGW_ADMIN__TOKEN_FILE=/run/secrets/admin``: its text, stripped), so it is
never in the environment. Only names with ``__`` are config keys: ``CACHEGW_CACHE_DIR`` and the other
single-name variables keep their own meaning. A name that matches no key is an error naming it.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PREFIX = "CACHEGW_"
SEP = "__"
FILE_SUFFIX = "_FILE"


def is_override(name: str) -> bool:
    """Whether an environment variable names a config key (``CACHEGW_`` and a ``__`` after it)."""
    return name.startswith(PREFIX) and SEP in name[len(PREFIX) :]


def parse_value(text: str, current: Any = None) -> Any:
    """A value as TOML (``8100``, ``true``, ``["a", "b"]``, ``{ a = 1 }``, ``"quoted"``); text that is
    no TOML value, or a key whose current value is a string, stays the text as given (``0.0.0.0``,
    a model named ``123``)."""
    if isinstance(current, str):
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _path(name: str) -> list[str]:
    return [part.lower() for part in name[len(PREFIX) :].split(SEP)]


def _lookup(data: Mapping[str, Any], open_tables: Mapping[str, Any], path: list[str]) -> tuple[bool, Any]:
    """Whether ``path`` names a key of ``data`` (and its current value), or a new entry of a table
    ``open_tables`` (the defaults) leave empty for the user to fill (``[tenants] keys``)."""
    if not all(path):
        return False, None
    node: Any = data
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            break
        node = node[part]
    else:
        return True, node
    parent: Any = open_tables
    for part in path[:-1]:
        parent = parent.get(part) if isinstance(parent, Mapping) else None
    return isinstance(parent, Mapping) and not parent and len(path) > 2, None


def _set(data: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    head, *rest = path
    if not rest:
        return {**data, head: value}
    return {**data, head: _set(dict(data.get(head) or {}), rest, value)}


def _read_secret(name: str, file: str) -> str:
    try:
        return Path(file).read_text(encoding="utf-8").strip()
    except OSError as err:
        raise ValueError(f"environment variable {name}: cannot read {file}: {err.strerror}") from None


def apply_env(
    data: dict[str, Any], environ: Mapping[str, str], defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``data`` (the defaults with the user's file over them) with every ``CACHEGW_*__*`` variable of
    ``environ`` laid over it. A variable naming no key (of ``data``, or a new entry of a table empty in
    ``defaults``), or a ``_FILE`` that cannot be read, is a ValueError naming the variable."""
    open_tables = data if defaults is None else defaults
    for name in sorted(n for n in environ if is_override(n)):
        if name.endswith(FILE_SUFFIX):  # a secret's file, when the name without _FILE is a key
            path = _path(name[: -len(FILE_SUFFIX)])
            known, current = _lookup(data, open_tables, path)
            if known:
                text = _read_secret(name, environ[name])
                data = _set(data, path, text if current is None else parse_value(text, current))
                continue
        path = _path(name)
        known, current = _lookup(data, open_tables, path)
        if known:
            data = _set(data, path, parse_value(environ[name], current))
            continue
        key = f"[{'.'.join(path[:-1])}] {path[-1]}"
        raise ValueError(
            f"environment variable {name}: no config key {key} "
            "(CACHEGW_<SECTION>__<KEY>, sub-tables joined by __; the keys are in docs/config.md)"
        )
    return data
