"""docs/config.md, generated: ``python -m cachegw.gateway.offline.config_docs > docs/config.md``.

Every section and key of config.toml with its type, default and meaning, from the models
(``gateway.config.Settings`` and the sections it holds) and the file's defaults;
tests/test_config_reference.py fails when docs/config.md is not what this prints.
"""

from __future__ import annotations

from cachegw.configtools.loader import load_defaults
from cachegw.configtools.reference import render
from cachegw.gateway.config import Settings

HEADER = """# Configuration reference

Generated from the schema (`gateway/config.py`, `gateway/cache_config.py`, `backend/config.py`,
`policies/canonicalize_config.py`) and [config.toml](../config.toml)'s defaults by `make config-docs`;
do not edit by hand. config.toml's comments say more about each key. A user's file (`--config FILE`)
needs only the keys it changes; an unknown key, a value out of range, or a key at a place it has moved
from stops the start with an error naming it. Any key can also be set by an environment variable,
`CACHEGW_<SECTION>__<KEY>` (sub-tables joined by `__`: `CACHEGW_CACHE__ENCODER__THREADS=2`; values as
TOML, `CACHEGW_GATEWAY__BACKENDS='["http://gpu1:8000/v1"]'`), which wins over the file; a secret can be
read from a file named by `CACHEGW_<SECTION>__<KEY>_FILE` (docs/operations.md)."""


def reference() -> str:
    return render(Settings, load_defaults(), HEADER)


if __name__ == "__main__":
    print(reference(), end="")
