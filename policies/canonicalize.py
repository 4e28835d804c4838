"""Request canonicalization: semantically identical prompts become byte-identical.

Why: the backend's prefix cache hashes token blocks, so one differing byte early in a prompt (CRLF,
a trailing space, an NFD accent, schema key order, tool order, a timestamp in the system prompt)
costs a full prefill. Pure and fast (about 0.1 ms for a 2 KB chat request); meaning never changes:
only whitespace, Unicode form, key and tool order move, and volatile values move, never vanish.

| rule | what it does | applies to |
|---|---|---|
| unicode_nfc | NFC | every text the model reads: contents, tool/schema descriptions, prompts |
| line_endings | CRLF, CR -> LF | the same |
| trailing_whitespace | spaces/tabs at line ends removed | prose of system/developer/user/assistant |
| blank_lines | at most one blank line; leading/trailing blank lines removed | the same |
| json_key_order | keys sorted | tools' ``parameters`` and ``response_format`` only |
| sort_tools | tools sorted by function name (stable) | ``tools`` |
| merge_system | leading system messages joined with a blank line | plain system messages |
| volatile_to_tail | volatile values (listed or learned) -> ``[volatile:N]``, to the tail | system/developer |
| restore_assistant | assistant text replaced by the stored bytes of our reply | assistant messages |

restore_assistant matches under ``normalize_reply``: prose whitespace is ignored, but code inside
fences must keep its lines and indentation, so a reply whose code the client changed is left alone.
The gateway keys replies per tenant.

Kept exactly (NFC and LF aside): whitespace inside ``` / ~~~ fences (indentation and trailing
spaces can matter in code), tool messages and tool-call arguments (data, not prose), completion
prompts (their last bytes are where generation starts), and the order of a schema's ``properties``
(structured outputs are generated in that order: "reasoning" before "answer" is a choice, not noise).
Volatile values are taken from fenced system text too: injected JSON context often holds the time.

Volatile values go to the END OF THE LAST USER MESSAGE as ``\\n\\nContext values: [volatile:1] = v;
...``. Not in a new message: several chat templates (Mistral, Llama 2, Gemma) reject a system
message after the first or two user messages in a row, so a new message could turn a good request
into a 400. Not right after the system prompt: values that change per request (request ids, clock
times) would then break the prefix of the whole conversation history; at the tail only the last
turn is lost. The text before the last user message therefore stays a byte-stable prefix. With no
user message the values stay where they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachegw.policies.canonical_schema import canonical_schema, canonical_tools
from cachegw.policies.canonical_text import normalize_reply, normalize_text, text_parts, texts_of
from cachegw.policies.canonicalize_config import CanonicalizeConfig
from cachegw.policies.volatile import (
    PLACEHOLDER,
    PLACEHOLDER_RE,
    Moved,
    Template,
    extract,
)

RULES: tuple[str, ...] = (
    "unicode_nfc", "line_endings", "trailing_whitespace", "blank_lines", "json_key_order",
    "sort_tools", "merge_system", "volatile_to_tail", "restore_assistant",
)  # fmt: skip
CONTEXT_PREFIX = "Context values: "
Restore = Callable[[str], str | None]
_PROSE_ROLES = frozenset({"system", "developer", "user", "assistant"})
_INSTRUCTION_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True)
class Canonical:
    """A canonical body with what canonicalization did: the rules that fired (in ``RULES`` order),
    the volatile values it moved, and the system/developer texts no learned template matched (after
    the listed patterns: what the gateway learns templates from)."""

    body: dict[str, Any]
    rules: list[str]
    moved: tuple[Moved, ...] = ()
    unmatched: tuple[str, ...] = ()


def canonicalize(
    body: dict[str, Any], cfg: CanonicalizeConfig, restore: Restore | None = None
) -> tuple[dict[str, Any], list[str]]:
    """A new, canonical body and the rules (in ``RULES`` order) that changed something. The result
    shares no dict or list with ``body``, which is never mutated. ``restore`` maps
    ``normalize_reply(reply)`` to the exact bytes of a reply the gateway produced, or None."""
    done = canonicalize_detail(body, cfg, restore)
    return done.body, done.rules


def canonicalize_detail(
    body: dict[str, Any],
    cfg: CanonicalizeConfig,
    restore: Restore | None = None,
    templates: Sequence[Template] = (),
) -> Canonical:
    """``canonicalize``, with the learned ``templates`` of the tenant (tried in order) and a report."""
    out = _copy(body)
    if not cfg.enabled:
        return Canonical(out, [])
    fired: set[str] = set()
    report = _Report(templates)
    if isinstance(out.get("messages"), list):
        out["messages"] = _messages(out["messages"], cfg, restore, fired, report)
    prompt = out.get("prompt")
    if isinstance(prompt, str):
        out["prompt"] = normalize_text(prompt, cfg, False, fired)
    elif isinstance(prompt, list):
        out["prompt"] = [normalize_text(p, cfg, False, fired) if isinstance(p, str) else p for p in prompt]
    if isinstance(out.get("tools"), list):
        out["tools"] = canonical_tools(out["tools"], cfg, fired)
    if isinstance(out.get("response_format"), dict):
        out["response_format"] = canonical_schema(out["response_format"], cfg, fired)  # its wrapper keys too
    return Canonical(out, [r for r in RULES if r in fired], tuple(report.moved), tuple(report.unmatched))


@dataclass
class _Report:
    templates: Sequence[Template]
    moved: list[Moved] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)


def _copy(o: Any) -> Any:
    """Deep copy of JSON data (several times faster than copy.deepcopy; all a parsed body holds)."""
    if isinstance(o, dict):
        return {k: _copy(v) for k, v in o.items()}
    return [_copy(v) for v in o] if isinstance(o, list) else o


def _messages(
    messages: list[Any], cfg: CanonicalizeConfig, restore: Restore | None, fired: set[str], report: _Report
) -> list[Any]:
    """Restore first (keyed on the client's text), merge, normalise text, then move volatile values."""
    restored = _restore_assistants(messages, restore, fired) if cfg.restore_assistant and restore else set()
    if cfg.merge_system:
        messages = _merge_system(messages, fired)
    for m in messages:
        if not isinstance(m, dict):
            continue
        prose = m.get("role") in _PROSE_ROLES  # tool (and unknown) roles: data, NFC and LF only
        if "content" in m and id(m) not in restored:
            m["content"] = _map_text(m["content"], lambda t, p=prose: normalize_text(t, cfg, p, fired))
        calls = m.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:  # a wrong type is the backend's to refuse
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                fn["arguments"] = normalize_text(fn["arguments"], cfg, False, fired)
    if cfg.volatile_to_tail and (cfg.volatile_regex is not None or cfg.learn.enabled):
        _volatile_to_tail(messages, cfg, fired, report)
    return messages


def _restore_assistants(messages: list[Any], restore: Restore, fired: set[str]) -> set[int]:
    """ids of assistant messages now holding our stored bytes (the text rules leave them alone). A
    reply is used only if it normalises to the same key: a store mix-up cannot change the words."""
    done: set[int] = set()
    for m in messages:
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        content = m.get("content")
        if isinstance(content, str):
            holder, slot = m, "content"
        elif isinstance(content, list) and len(content) == 1 and text_parts(content):
            holder, slot = content[0], "text"
        else:
            continue
        key = normalize_reply(holder[slot])
        stored = restore(key) if key else None
        if isinstance(stored, str) and normalize_reply(stored) == key:
            done.add(id(m))
            if stored != holder[slot]:
                holder[slot] = stored
                fired.add("restore_assistant")
    return done


def _merge_system(messages: list[Any], fired: set[str]) -> list[Any]:
    """Leading plain system messages become one: templates render one system block, and clients
    differ in whether they split it. Text parts join with a newline as the backend joins them."""
    texts: list[str] = []
    for m in messages:
        plain = isinstance(m, dict) and m.get("role") == "system" and set(m) <= {"role", "content"}
        content = m.get("content") if plain else None
        parts = text_parts(content)
        if isinstance(content, str):
            texts.append(content)
        elif parts and len(parts) == len(content):
            texts.append("\n".join(p["text"] for p in parts))
        else:
            break
    if len(texts) < 2:
        return messages
    fired.add("merge_system")
    return [{"role": "system", "content": "\n\n".join(t for t in texts if t)}, *messages[len(texts) :]]


def _volatile_to_tail(messages: list[Any], cfg: CanonicalizeConfig, fired: set[str], report: _Report) -> None:
    """Volatile values in system/developer text (listed patterns, then learned templates) become
    placeholders, listed at the end of the last user message. Equal values share a number; numbers
    continue after any placeholder already there."""
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    target = next((m for m in reversed(users) if isinstance(m.get("content"), str | list)), None)
    if target is None:
        return  # nowhere to put the values: leave the prompt as it is
    instructions = [m for m in messages if isinstance(m, dict) and m.get("role") in _INSTRUCTION_ROLES]
    found = [n for m in instructions for t in texts_of(m.get("content")) for n in PLACEHOLDER_RE.findall(t)]
    base = max(map(int, found), default=0)
    values: dict[str, int] = {}
    templates = report.templates if cfg.learn.enabled else ()

    def one(text: str) -> str:
        text, matched = extract(text, cfg.volatile_regex, templates, values, base, report.moved)
        if not matched and cfg.learn.enabled:
            report.unmatched.append(text)
        return text

    for m in instructions:
        if "content" in m:
            m["content"] = _map_text(m["content"], one)
    if not values:
        return
    fired.add("volatile_to_tail")
    note = CONTEXT_PREFIX + "; ".join(f"{PLACEHOLDER.format(n)} = {v}" for v, n in values.items())
    # The user text is canonical already; normalising it with the note keeps the result a fixed point.
    append = lambda t: normalize_text(t + ("\n\n" if t.strip() else "") + note, cfg, True, set())
    content = target["content"]
    if isinstance(content, str):
        target["content"] = append(content)
    elif content and any(p is content[-1] for p in text_parts(content)):
        content[-1]["text"] = append(content[-1]["text"])
    else:
        content.append({"type": "text", "text": note})


def split_volatile_note(text: str) -> tuple[str, str]:
    """(the text without the note ``volatile_to_tail`` appended, the note or "")."""
    at = text.rfind(CONTEXT_PREFIX)
    if at < 0 or not PLACEHOLDER_RE.match(text, at + len(CONTEXT_PREFIX)):
        return text, ""
    return text[:at].removesuffix("\n\n").removesuffix("\n"), text[at:]  # "\n": a part joined on


def without_volatile_note(content: Any) -> Any:
    """A user message's content without the note ``volatile_to_tail`` appended (for keys that must be the
    same on the turn that carried the note and on the later turns that send the message without it)."""
    if isinstance(content, str):
        return split_volatile_note(content)[0]
    if isinstance(content, list) and content and isinstance(content[-1], dict):
        last = content[-1]
        if isinstance(last.get("text"), str):
            text = split_volatile_note(last["text"])[0]
            return content[:-1] + ([{**last, "text": text}] if text else [])
    return content


def _map_text(content: Any, fn: Callable[[str], str]) -> Any:
    """``fn`` applied to a string content, or to each text part of a list content (in place)."""
    if isinstance(content, str):
        return fn(content)
    for p in text_parts(content):
        p["text"] = fn(p["text"])
    return content
