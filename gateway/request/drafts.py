"""A refused near miss's stored answer as the backend's draft (``cachegw_draft``).

A paraphrase the verifier would not serve is often answered with much the same text. The built-in
engine verifies a draft in one forward pass per few tokens (speculative decoding), so the fresh
answer comes faster where the model says the same and costs little where it does not; the answer
itself is the model's either way. Only text answers make drafts: a tool call carries the other
user's arguments, which the model would rarely repeat.
"""

from __future__ import annotations

import json

from gateway.cache.lookup import Lookup


def draft_for(lookup: Lookup | None) -> str | None:
    """The text of the nearest refused candidate's answer, if the lookup had one."""
    entry = lookup.refused if lookup is not None else None
    if entry is None:
        return None
    try:
        choice = json.loads(entry.response)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(choice, dict):
        return None
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return text if isinstance(text, str) and text else None
