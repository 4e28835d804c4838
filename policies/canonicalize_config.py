"""config.toml [canonicalize] as a typed, validated object (what each rule's switch does:
``policies/canonicalize.py``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import Field, PrivateAttr, StrictBool, StrictStr, model_validator

from cachegw.configtools import Strict, typed_section
from cachegw.policies.volatile import (
    DEFAULT_VOLATILE_PATTERNS,
    LearnConfig,
    combine,
)


class CanonicalizeConfig(Strict):
    """config.toml [canonicalize]; defaults equal the file's (a test keeps them in step)."""

    enabled: StrictBool = Field(
        default=True, description="make semantically identical prompts byte-identical"
    )
    unicode_nfc: StrictBool = Field(default=True, description="NFC for every text the model reads")
    line_endings: StrictBool = Field(default=True, description="CRLF, CR -> LF")
    trailing_whitespace: StrictBool = Field(
        True, description="spaces/tabs at line ends removed (prose, not code fences)"
    )
    blank_lines: StrictBool = Field(
        default=True, description="at most one blank line; leading/trailing ones removed (prose)"
    )
    json_key_order: StrictBool = Field(
        True, description="keys sorted in tools' parameters and response_format"
    )
    sort_tools: StrictBool = Field(default=True, description="tools sorted by function name (stable)")
    merge_system: StrictBool = Field(
        default=True, description="leading plain system messages joined with a blank line"
    )
    volatile_to_tail: StrictBool = Field(
        True, description="volatile values moved from the system prompt to the end of the last user message"
    )
    restore_assistant: StrictBool = Field(
        True, description="assistant text replaced by the stored bytes of the gateway's own reply"
    )
    volatile_patterns: tuple[StrictStr, ...] = Field(
        DEFAULT_VOLATILE_PATTERNS, description="Python regexes of volatile values, matched case-insensitively"
    )
    learn: LearnConfig = Field(default=LearnConfig(), description="volatile spans learned from traffic")
    _volatile: re.Pattern[str] | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _patterns_are_a_list(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and isinstance(data.get("volatile_patterns"), str):
            raise ValueError("[canonicalize] volatile_patterns must be a list of strings")
        return data

    @model_validator(mode="after")
    def _compile(self) -> CanonicalizeConfig:
        """Compile once at start-up, so a bad pattern fails there and not on a request."""
        self._volatile = combine(self.volatile_patterns)
        return self

    @property
    def volatile_regex(self) -> re.Pattern[str] | None:
        """Every volatile pattern as one case-insensitive alternation (None without patterns)."""
        return self._volatile

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CanonicalizeConfig:
        """From the TOML section; an unknown key is a typo that would silently do nothing: an error."""
        return typed_section(cls, d, "canonicalize")
