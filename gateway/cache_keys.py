"""What makes two requests the same (exact key) or comparable (semantic scope).

Exact key: tenant, model, endpoint, every message (or the prompt) and every parameter that can
change the output. Scope: the same minus the last user message: system prompt, earlier turns,
tools, response_format and the output-changing parameters. Within a scope only the last user
message is compared by meaning; across scopes nothing is ever compared, so an answer given in
another conversation, under another system prompt or to another tenant cannot be served.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from policies.canonicalize import canonical_json

# Fields that do not change the answer's content: left out of both keys. max_tokens is checked
# against the stored answer instead (a truncated answer is not served to a longer max_tokens).
_NOT_OUTPUT = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "stream",
        "stream_options",
        "user",
        "metadata",
        "store",
        "max_tokens",
        "max_completion_tokens",
        "cache_salt",
        "service_tier",
    }
)


@dataclass(frozen=True)
class RequestKeys:
    exact: str
    scope: str | None  # None: no semantic tier for this request (the last message is not a user's)
    query: str | None  # the text compared by meaning
    max_tokens: int | None
    system: str | None = None  # short hash of the system/developer messages (reports group by it)


def _digest(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def text_of(content: Any) -> str | None:
    """The text of a message content: a string, or the text parts of a list (None if it has others)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        if all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            return "\n".join(p["text"] for p in content)
    return None


def request_keys(tenant: str, model: str, endpoint: str, body: dict[str, Any]) -> RequestKeys:
    params = {k: v for k, v in body.items() if k not in _NOT_OUTPUT}
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    head = {"tenant": tenant, "model": model, "endpoint": endpoint, "params": params}
    if endpoint == "chat":
        messages = body.get("messages") or []
        exact = _digest({**head, "messages": messages})
        last = messages[-1] if messages else None
        query = (
            text_of(last.get("content")) if isinstance(last, dict) and last.get("role") == "user" else None
        )
        scope = _digest({**head, "context": messages[:-1]}) if query else None
        instructions = [
            m for m in messages if isinstance(m, dict) and m.get("role") in ("system", "developer")
        ]
        system = _digest(instructions)[:16] if instructions else None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        exact = _digest({**head, "prompt": prompt})
        query = prompt if isinstance(prompt, str) else None
        scope = _digest(head) if query else None
        system = None
    if query is not None and not query.strip():
        query = scope = None
    return RequestKeys(exact, scope, query, max_tokens if isinstance(max_tokens, int) else None, system)
