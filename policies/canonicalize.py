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

import json
import re
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from configtools import check_known_keys
from policies.volatile import (
    DEFAULT_VOLATILE_PATTERNS,
    PLACEHOLDER,
    PLACEHOLDER_RE,
    LearnConfig,
    Moved,
    Template,
    combine,
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
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # instance values, not schema
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})(.*)$", re.M)
_TRAILING_WS = re.compile(r"[ \t]+(?=\n|\Z)")
_BLANK_RUN = re.compile(r"\n(?:[ \t]*\n){2,}")


@dataclass(frozen=True)
class CanonicalizeConfig:
    """config.toml [canonicalize]; defaults equal the file's (a test keeps them in step)."""

    enabled: bool = True
    unicode_nfc: bool = True
    line_endings: bool = True
    trailing_whitespace: bool = True
    blank_lines: bool = True
    json_key_order: bool = True
    sort_tools: bool = True
    merge_system: bool = True
    volatile_to_tail: bool = True
    restore_assistant: bool = True
    volatile_patterns: tuple[str, ...] = DEFAULT_VOLATILE_PATTERNS
    learn: LearnConfig = LearnConfig()  # volatile spans learned from traffic ([canonicalize.learn])

    def __post_init__(self) -> None:
        """Validate and compile once at start-up, so a bad setting fails there and not on a request."""
        for f in fields(self):
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"[canonicalize] {f.name} must be true or false")
        patterns = self.volatile_patterns
        if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
            raise ValueError("[canonicalize] volatile_patterns must be a list of strings")
        object.__setattr__(self, "volatile_patterns", tuple(patterns))
        object.__setattr__(self, "_volatile", combine(self.volatile_patterns))  # not a field
        if not isinstance(self.learn, LearnConfig):
            raise ValueError("[canonicalize] learn must be a table")

    @property
    def volatile_regex(self) -> re.Pattern[str] | None:
        """Every volatile pattern as one case-insensitive alternation (None without patterns)."""
        return self._volatile  # type: ignore[attr-defined, no-any-return]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CanonicalizeConfig:
        """From the TOML section; an unknown key is a typo that would silently do nothing: an error."""
        check_known_keys(cls, d, "canonicalize")
        learn = d.get("learn", {})
        if not isinstance(learn, Mapping):
            raise ValueError("[canonicalize] learn must be a table")
        check_known_keys(LearnConfig, learn, "canonicalize.learn")
        return cls(**{**d, "learn": LearnConfig(**learn)})


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
        out["prompt"] = _text(prompt, cfg, False, fired)
    elif isinstance(prompt, list):
        out["prompt"] = [_text(p, cfg, False, fired) if isinstance(p, str) else p for p in prompt]
    if isinstance(out.get("tools"), list):
        out["tools"] = _tools(out["tools"], cfg, fired)
    if isinstance(out.get("response_format"), dict):
        out["response_format"] = _schema(out["response_format"], cfg, fired)  # its wrapper keys too
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


def _text(text: str, cfg: CanonicalizeConfig, prose: bool, fired: set[str]) -> str:
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


def _text_parts(content: Any) -> list[dict[str, Any]]:
    """The text parts of a list content (images and others are never touched)."""
    if not isinstance(content, list):
        return []
    return [
        p
        for p in content
        if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
    ]


def _texts(content: Any) -> list[str]:
    return [content] if isinstance(content, str) else [p["text"] for p in _text_parts(content)]


def _map_text(content: Any, fn: Callable[[str], str]) -> Any:
    """``fn`` applied to a string content, or to each text part of a list content (in place)."""
    if isinstance(content, str):
        return fn(content)
    for p in _text_parts(content):
        p["text"] = fn(p["text"])
    return content


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
            m["content"] = _map_text(m["content"], lambda t, p=prose: _text(t, cfg, p, fired))
        calls = m.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:  # a wrong type is the backend's to refuse
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                fn["arguments"] = _text(fn["arguments"], cfg, False, fired)
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
        elif isinstance(content, list) and len(content) == 1 and _text_parts(content):
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
        parts = _text_parts(content)
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
    found = [n for m in instructions for t in _texts(m.get("content")) for n in PLACEHOLDER_RE.findall(t)]
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
    append = lambda t: _text(t + ("\n\n" if t.strip() else "") + note, cfg, True, set())
    content = target["content"]
    if isinstance(content, str):
        target["content"] = append(content)
    elif content and any(p is content[-1] for p in _text_parts(content)):
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


def _tools(tools: list[Any], cfg: CanonicalizeConfig, fired: set[str]) -> list[Any]:
    """Descriptions NFC/LF, parameter schemas canonical, then a stable sort by function name."""
    names = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        if isinstance(fn.get("description"), str):
            fn["description"] = _text(fn["description"], cfg, False, fired)
        if isinstance(fn.get("parameters"), dict):
            fn["parameters"] = _schema(fn["parameters"], cfg, fired)
        names.append(fn["name"] if isinstance(fn.get("name"), str) else "")
    if not cfg.sort_tools or names == sorted(names):
        return tools
    fired.add("sort_tools")
    return [tool for _, _, tool in sorted(zip(names, range(len(tools)), tools, strict=True))]


def _schema(node: Any, cfg: CanonicalizeConfig, fired: set[str]) -> Any:
    """Keys sorted at every level, except the order of ``properties`` (the generation order of
    structured output) and instance values under enum/const/default/examples (data, kept as sent).
    Descriptions and titles are text the model reads: NFC and LF."""
    if isinstance(node, list):
        return [_schema(v, cfg, fired) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in _DATA_KEYWORDS:
            out[k] = v
        elif k == "properties" and isinstance(v, dict):
            out[k] = {name: _schema(sub, cfg, fired) for name, sub in v.items()}
        elif k in ("description", "title") and isinstance(v, str):
            out[k] = _text(v, cfg, False, fired)
        else:
            out[k] = _schema(v, cfg, fired)
    return _sorted(out, cfg, fired)


def _sorted(d: dict[str, Any], cfg: CanonicalizeConfig, fired: set[str]) -> dict[str, Any]:
    if not cfg.json_key_order or list(d) == sorted(d):
        return d
    fired.add("json_key_order")
    return {k: d[k] for k in sorted(d)}
