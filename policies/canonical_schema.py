"""Canonical tools and JSON schemas: descriptions normalised, keys sorted except where order is meaning
(a schema's ``properties``, instance values), tools in a stable order by function name.
"""

from __future__ import annotations

from typing import Any

from cachegw.policies.canonical_text import normalize_text
from cachegw.policies.canonicalize_config import CanonicalizeConfig

_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # instance values, not schema


def canonical_tools(tools: list[Any], cfg: CanonicalizeConfig, fired: set[str]) -> list[Any]:
    """Descriptions NFC/LF, parameter schemas canonical, then a stable sort by function name."""
    names = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        if isinstance(fn.get("description"), str):
            fn["description"] = normalize_text(fn["description"], cfg, False, fired)
        if isinstance(fn.get("parameters"), dict):
            fn["parameters"] = canonical_schema(fn["parameters"], cfg, fired)
        names.append(fn["name"] if isinstance(fn.get("name"), str) else "")
    if not cfg.sort_tools or names == sorted(names):
        return tools
    fired.add("sort_tools")
    return [tool for _, _, tool in sorted(zip(names, range(len(tools)), tools, strict=True))]


def canonical_schema(node: Any, cfg: CanonicalizeConfig, fired: set[str]) -> Any:
    """Keys sorted at every level, except the order of ``properties`` (the generation order of
    structured output) and instance values under enum/const/default/examples (data, kept as sent).
    Descriptions and titles are text the model reads: NFC and LF."""
    if isinstance(node, list):
        return [canonical_schema(v, cfg, fired) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in _DATA_KEYWORDS:
            out[k] = v
        elif k == "properties" and isinstance(v, dict):
            out[k] = {name: canonical_schema(sub, cfg, fired) for name, sub in v.items()}
        elif k in ("description", "title") and isinstance(v, str):
            out[k] = normalize_text(v, cfg, False, fired)
        else:
            out[k] = canonical_schema(v, cfg, fired)
    return _sorted(out, cfg, fired)


def _sorted(d: dict[str, Any], cfg: CanonicalizeConfig, fired: set[str]) -> dict[str, Any]:
    if not cfg.json_key_order or list(d) == sorted(d):
        return d
    fired.add("json_key_order")
    return {k: d[k] for k in sorted(d)}
