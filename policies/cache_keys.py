"""What makes two requests the same (exact key) or comparable (semantic scope).

Exact key: tenant, model, endpoint, every message (or the prompt) and every parameter that can
change the output. Scope: the same minus the text of the last user message: system prompt, earlier
turns, tools, response_format, the output-changing parameters, the last message's other fields
(``name``) and the volatile values canonicalization moved into it. Within a scope only the last user
message's own text is compared by meaning; across scopes nothing is ever compared, so an answer given
in another conversation, under another system prompt or to another tenant cannot be served.

Tool-call ids are keyed by position (``_positional_call_ids``): an id is a random name the backend or
the gateway minted, and a replayed tool call gets a fresh one, so the follow-up turn that carries it
back must still repeat the original turn exactly. What a tool result answers (which call, in which
order) is kept; the random name is not.

Hashes keep the order of JSON-schema ``properties`` (it is the order structured output is generated
in); every other object is hashed with sorted keys.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from cachegw.policies.cacheability import exact_only
from cachegw.policies.canonical_text import canonical_json
from cachegw.policies.canonicalize import split_volatile_note

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
        "service_tier",
        "priority",
        "cachegw_draft",  # a speculative-decoding hint: the answer is the same with or without it
        # prompt caching: what the backend keeps of the prompt, and where (never the answer)
        "cache_pins",
        "prompt_cache_key",
        "prompt_cache_retention",
    }
)


@dataclass(frozen=True)
class RequestKeys:
    exact: str
    scope: str | None  # None: no semantic tier for this request (the last message is not a user's)
    query: str | None  # the text compared by meaning
    max_tokens: int | None
    system: str | None = None  # short hash of the system/developer messages (reports group by it)


def _ordered_properties(obj: Any) -> Any:
    """Every ``properties`` object becomes a list of [name, schema] pairs, so sorting keys cannot
    merge two schemas whose fields are generated in a different order."""
    if isinstance(obj, dict):
        return {
            k: [[n, _ordered_properties(v)] for n, v in val.items()]
            if k == "properties" and isinstance(val, dict)
            else _ordered_properties(val)
            for k, val in obj.items()
        }
    return [_ordered_properties(v) for v in obj] if isinstance(obj, list) else obj


def _digest(obj: Any) -> str:
    return hashlib.sha256(canonical_json(_ordered_properties(obj)).encode()).hexdigest()


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


def _positional_call_ids(messages: list[Any]) -> list[Any]:
    """A copy of the messages with every tool-call id (an assistant's ``tool_calls[].id``, a tool
    message's ``tool_call_id``) renamed ``#N`` by its first appearance; the body itself is untouched."""
    names: dict[str, str] = {}

    def rename(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        return names.setdefault(value, f"#{len(names)}")

    out: list[Any] = []
    for m in messages:
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = dict(m)
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            m["tool_calls"] = [
                {**c, "id": rename(c["id"])} if isinstance(c, dict) and "id" in c else c for c in calls
            ]
        if "tool_call_id" in m:
            m["tool_call_id"] = rename(m["tool_call_id"])
        out.append(m)
    return out


def request_keys(tenant: str, model: str, endpoint: str, body: dict[str, Any]) -> RequestKeys:
    params = {k: v for k, v in body.items() if k not in _NOT_OUTPUT}
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:  # 0 is a value (the backend refuses it), not "absent"
        max_tokens = body.get("max_tokens")
    head = {"tenant": tenant, "model": model, "endpoint": endpoint, "params": params}
    if endpoint == "chat":
        messages = _positional_call_ids(body.get("messages") or [])
        exact = _digest({**head, "messages": messages})
        last = messages[-1] if messages else None
        user_turn = isinstance(last, dict) and not exact_only(body)
        text = text_of(last.get("content")) if user_turn and isinstance(last, dict) else None
        query, note = split_volatile_note(text) if text is not None else (None, "")
        scope = None
        if query:
            context: dict[str, Any] = {**head, "context": messages[:-1]}
            extra = {k: v for k, v in last.items() if k not in ("role", "content")}
            if extra:  # "name" tells end users apart: Alice's answer is not Bob's
                context["last"] = extra
            if note:  # the date an answer was given under is part of its context, not of the question
                context["volatile"] = note
            scope = _digest(context)
        instructions = [
            m for m in messages if isinstance(m, dict) and m.get("role") in ("system", "developer")
        ]
        system = _digest(instructions)[:16] if instructions else None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        exact = _digest({**head, "prompt": prompt})
        # echo returns the prompt itself: a paraphrase would get the stored prompt back
        query = prompt if isinstance(prompt, str) and not body.get("echo") else None
        scope = _digest(head) if query else None
        system = None
    if query is not None and not query.strip():
        query = scope = None
    return RequestKeys(exact, scope, query, max_tokens if isinstance(max_tokens, int) else None, system)
