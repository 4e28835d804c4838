"""How learned volatile templates travel through the database: their JSON, checked on the way back
(a corrupt or unknown row is skipped, never applied). Which rows a replica reads, the change log says
(``gateway/storage/changes.py``)."""

from __future__ import annotations

import json

from cachegw.gateway.storage.volatile_store import StoredTemplate
from cachegw.policies.volatile import Template

FORMAT = 1  # the JSON's version: a row of another is skipped


def encode(template: Template) -> str:
    """Its constant parts (the spans lie between them, labelled) and how long a value may be."""
    return json.dumps(
        {
            "format": FORMAT,
            "parts": list(template.parts),
            "spans": list(template.labels),
            "max_value_chars": template.max_value_chars,
        },
        ensure_ascii=False,
    )


def decode(row: StoredTemplate) -> Template:
    """The row's template; ValueError if it is not one this version wrote, or its id does not
    match its parts (so a row edited by hand never moves values under another template's name)."""
    try:
        data = json.loads(row.template)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError("unknown format")
    parts, chars = data.get("parts"), data.get("max_value_chars")
    if not isinstance(parts, list) or len(parts) < 2 or not all(isinstance(p, str) for p in parts):
        raise ValueError("parts must be two or more strings")
    if not isinstance(chars, int) or isinstance(chars, bool) or chars < 1:
        raise ValueError("max_value_chars must be a positive integer")
    template = Template.of(tuple(parts), chars)
    if template.id != row.template_id:
        raise ValueError(f"its parts are template {template.id}, not {row.template_id}")
    return template
