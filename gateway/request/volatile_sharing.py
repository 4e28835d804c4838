"""How learned volatile templates travel through the database: their JSON, checked on the way back
(a corrupt or unknown row is skipped, never applied), and the cursor of rows a replica has read.

Why a cursor with holes: on PostgreSQL ids come from a sequence and commit out of order, so a row
with a lower id can appear after a higher one was read; an insert that finds the template stored
uses an id too. An id skipped below the highest read is asked for again for ``HOLE_WAIT_S``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from cachegw.gateway.storage.volatile_store import StoredTemplate
from cachegw.policies.volatile import Template

FORMAT = 1  # the JSON's version: a row of another is skipped
HOLE_WAIT_S = 60.0  # how long a skipped id may still be committed
MAX_HOLES = 1000  # ids skipped at once beyond this are not awaited


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


@dataclass
class RowCursor:
    """The highest row id read, and the lower ids not seen yet that may still be committed."""

    seen: int = 0
    holes: dict[int, float] = field(default_factory=dict)  # id: when it was first missed

    def start(self) -> int:
        """Read the rows after this id."""
        return min(self.holes, default=self.seen + 1) - 1

    def advance(self, ids: list[int], now: float) -> None:
        for i in ids:
            self.holes.pop(i, None)
        top = max(ids, default=self.seen)
        if top > self.seen:
            if top - self.seen <= MAX_HOLES:
                got = set(ids)
                self.holes.update((i, now) for i in range(self.seen + 1, top) if i not in got)
            self.seen = top
        self.holes = {i: t for i, t in self.holes.items() if now - t < HOLE_WAIT_S}
