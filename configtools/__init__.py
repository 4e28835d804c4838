"""Config sections as frozen pydantic models: the base and the error wording every section shares.

A package of its own, importing nothing of ours, so ``backend/``, ``policies/`` and ``gateway/`` may all
use it without an import against the one-way graph (tests/test_import_graph.py). ``loader`` reads
config.toml (a user's file and ``env``'s ``CACHEGW_*__*`` variables over it); ``reference`` writes
docs/config.md from the models; ``logs`` sets up the commands' text or JSON log.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

T = TypeVar("T", bound=BaseModel)


class Strict(BaseModel):
    """A config section: frozen, unknown keys refused, every field with a one-line ``description``."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def section_error(error: ValidationError, section: str) -> ValueError:
    """A validation error as one line naming the section and its keys: unknown keys first, then the
    invalid values (``invalid engine config value(s): dtype='f8': ...``)."""
    unknown, invalid = [], []
    for e in error.errors(include_url=False):
        key = ".".join(str(p) for p in e["loc"]) or "(section)"
        if e["type"] == "extra_forbidden":
            unknown.append(key)
        else:
            shown = f"{key}={e['input']!r}" if not isinstance(e["input"], Mapping) else key
            invalid.append(f"{shown}: {_meaning(key, e)}")
    if unknown:
        return ValueError(f"config [{section}]: unknown keys {sorted(unknown)}")
    return ValueError(f"invalid {section} config value(s): {'; '.join(invalid)}")


def typed_section(cls: type[T], raw: Mapping[str, Any], section: str) -> T:
    """A config section as its model; unknown keys and bad values are one clear error naming them."""
    try:
        return cls.model_validate(dict(raw))
    except ValidationError as e:
        raise section_error(e, section) from None


def _meaning(key: str, error: Any) -> str:
    """Pydantic's message, except a choice, which names every allowed value as the docs do."""
    if error["type"] != "literal_error":
        return str(error["msg"])
    expected = str(error.get("ctx", {}).get("expected", ""))
    choices = [c.strip().strip("'\"") for c in expected.replace(" or ", ", ").split(", ") if c.strip()]
    return f"{key.rsplit('.', 1)[-1]} is one of {', '.join(choices)}"
