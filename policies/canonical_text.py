"""Canonical text: NFC and LF everywhere, the whitespace rules on prose only and never inside code fences;
the forms replies and queries are matched under; stable JSON for hashing.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

from cachegw.policies.canonicalize_config import CanonicalizeConfig

_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})(.*)$", re.M)
_TRAILING_WS = re.compile(r"[ \t]+(?=\n|\Z)")
_BLANK_RUN = re.compile(r"\n(?:[ \t]*\n){2,}")


def normalize_for_match(text: str) -> str:
    """The form repeats of one query are grouped under: NFC, whitespace runs -> one space, stripped."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def normalize_reply(text: str) -> str:
    """The form under which the gateway's replies are stored and found again when a client sends one
    back re-formatted: NFC and LF; whitespace runs in prose become one space; inside code fences only
    trailing spaces and blank lines go, since indentation is meaning there (Python, YAML)."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    pieces = (
        "\n".join(line.rstrip() for line in piece.split("\n") if line.strip())
        if code
        else " ".join(piece.split())
        for code, piece in _segments(text)
    )
    return "\n".join(p for p in pieces if p)


def canonical_json(obj: Any) -> str:
    """Stable JSON for hashing: sorted keys, no spaces, UTF-8 text, and 1.0 written as 1 (same number)."""
    return json.dumps(_integral_floats(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _integral_floats(o: Any) -> Any:
    if isinstance(o, float):
        return int(o) if o.is_integer() and abs(o) < 2**53 else o
    if isinstance(o, dict):
        return {k: _integral_floats(v) for k, v in o.items()}
    return [_integral_floats(v) for v in o] if isinstance(o, list | tuple) else o


def normalize_text(text: str, cfg: CanonicalizeConfig, prose: bool, fired: set[str]) -> str:
    """NFC and LF everywhere; the whitespace rules only on prose, and never inside code fences."""
    if cfg.unicode_nfc and not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
        fired.add("unicode_nfc")
    if cfg.line_endings and "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        fired.add("line_endings")
    if not prose or not (cfg.trailing_whitespace or cfg.blank_lines):
        return text
    pieces = _segments(text)
    last = len(pieces) - 1
    return "".join(
        s if code else _prose(s, cfg, i == 0, i == last, fired) for i, (code, s) in enumerate(pieces)
    )


def _prose(s: str, cfg: CanonicalizeConfig, first: bool, last: bool, fired: set[str]) -> str:
    """Trailing spaces, then blank lines; the start and the end of the whole text lose theirs too."""
    if cfg.trailing_whitespace:
        new = _TRAILING_WS.sub("", s)
        if new != s:
            fired.add("trailing_whitespace")
            s = new
    if not cfg.blank_lines:
        return s
    new = _BLANK_RUN.sub("\n\n", s)
    if first:  # whole blank lines go; the first real line keeps its indentation
        new = new[new.rfind("\n", 0, len(new) - len(new.lstrip(" \t\n"))) + 1 :]
    if last:  # blank lines and the final newline go; the last line's own spaces are not blank lines
        cut = new.find("\n", len(new.rstrip(" \t\n")))
        new = new[:cut] if cut >= 0 else new
    if new != s:
        fired.add("blank_lines")
    return new


def _segments(text: str) -> list[tuple[bool, str]]:
    """(is_code, piece) pieces. A fence may be indented (list items); a backtick fence with a backtick
    in its info string is inline code (CommonMark); an unclosed fence runs to the end."""
    if "```" not in text and "~~~" not in text:
        return [(False, text)]
    spans: list[tuple[int, int]] = []
    opened: tuple[int, str] | None = None
    for m in _FENCE.finditer(text):
        fence, rest = m.group(1), m.group(2)
        if opened is None:
            if not (fence[0] == "`" and "`" in rest):
                opened = (m.start(), fence)
        elif fence[0] == opened[1][0] and len(fence) >= len(opened[1]) and not rest.strip(" \t"):
            spans.append((opened[0], m.end()))
            opened = None
    if opened is not None:
        spans.append((opened[0], len(text)))
    pieces, pos = [], 0
    for start, end in spans:
        pieces += [(False, text[pos:start]), (True, text[start:end])]
        pos = end
    return [*pieces, (False, text[pos:])]


def text_parts(content: Any) -> list[dict[str, Any]]:
    """The text parts of a list content (images and others are never touched)."""
    if not isinstance(content, list):
        return []
    return [
        p
        for p in content
        if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
    ]


def texts_of(content: Any) -> list[str]:
    return [content] if isinstance(content, str) else [p["text"] for p in text_parts(content)]
