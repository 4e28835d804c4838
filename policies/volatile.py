"""Volatile values in system prompts: the listed patterns, and spans learned from traffic.

Listed patterns (config.toml ``volatile_patterns``: dates, ids, clock times) match case-insensitively,
as one alternation. They cannot know every form an application puts a per-request value in
("Customer tier: GOLD", "session=9f2c", "Kontonummer 4711"), and one such value early in a system
prompt costs the backend's prefix cache everything after it on every request. Requests of one tenant
and template show what varies: align a new system prompt against recent ones (a token diff); once
``min_requests`` different prompts fit one template, a span whose value differs from its most common
one in at least ``min_changes`` of them, while the text around it stays the same, is volatile. The
template is the prompt with those spans abstracted; canonicalization moves the values a template
matches out of the prompt like the listed ones (into the note on the last user message, so they stay
part of the cache scope).

Pure: ``learn`` gets the recent prompts and returns a template or None, ``extract`` applies the
patterns and templates to one text; the gateway keeps the state (``gateway/request/volatile_learner.py``).
Conservative: a prompt that differs widely from the others is a new template, not a volatile span; a
span is short, on one line, with the same text on both sides in every prompt it was learned from; the
constant text is most of the prompt.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher

from pydantic import Field, StrictBool, StrictFloat, StrictInt

from cachegw.configtools import Strict

DEFAULT_VOLATILE_PATTERNS: tuple[str, ...] = (
    r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?\b",
    r"\b\d{4}-\d{2}-\d{2}\b",
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b",
    r"\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,? +(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*"
    r" +\d{1,2}(?:,? +\d{4})?\b",
    r"\b(?:request|req|trace|session)[-_ ]?id[:= ]+[\w-]+",
    r"\b\d{1,2}:\d{2}(:\d{2})? ?(?:AM|PM|am|pm|UTC)?\b",
    r"\b1[6-9]\d{8}(\d{3})?\b",
)
PLACEHOLDER = "[volatile:{}]"
PLACEHOLDER_RE = re.compile(r"\[volatile:(\d+)\]")
_PREFIX = "_cachegw_v"
_GROUP = _PREFIX + "{}"  # the named group of listed pattern N, to tell which one matched
_NUMBERED_BACKREF = re.compile(r"(?<!\\)(?:\\\\)*\\[1-9]")
_TOKEN = re.compile(r"\w+|\s+|[^\w\s]")  # "".join(tokens) == text
_CHUNK = re.compile(r"\s+|\S+\s*")
_SENTENCE = re.compile(r"[^.!?\n]+[.!?]*\s*|[.!?]+\s*|\n\s*")  # up to its end mark, spaces after
_LEVELS = (_SENTENCE, _CHUNK, _TOKEN)
_WORD = re.compile(r"\w")
_PLACEHOLDER = "[volatile:"


def combine(patterns: Sequence[str]) -> re.Pattern[str] | None:
    """One case-insensitive alternation, so a prompt is scanned once (7 scans cost 4x more); the
    leftmost match wins, then the earlier pattern. So each pattern must work inside an alternation: no
    global inline flags (a scoped ``(?-i:...)`` is fine), no numbered backreferences, unique group
    names."""
    for p in patterns:
        try:
            re.compile(f"(?:{p})")
            if _NUMBERED_BACKREF.search(p):
                raise re.error("numbered backreference; use (?P<name>...) and (?P=name)")
        except re.error as e:
            raise ValueError(f"[canonicalize] volatile_patterns: invalid regex {p!r}: {e}") from e
    try:
        alternation = "|".join(f"(?P<{_GROUP.format(i)}>{p})" for i, p in enumerate(patterns, 1))
        return re.compile(alternation, re.IGNORECASE) if patterns else None
    except re.error as e:
        raise ValueError(f"[canonicalize] volatile_patterns: group names must be unique: {e}") from e


@dataclass(frozen=True)
class Moved:
    """One value moved out of a system prompt: by which listed pattern (its number) or learned
    template (its id), and the words before it."""

    kind: str  # "pattern" | "learned"
    name: str
    label: str

    @property
    def tag(self) -> str:
        return f"{self.kind}:{self.name}" + (f"[{self.label}]" if self.kind == "learned" else "")


def extract(
    text: str,
    regex: re.Pattern[str] | None,
    templates: Sequence[Template],
    values: dict[str, int],
    base: int,
    moved: list[Moved],
) -> tuple[str, bool]:
    """``text`` with its volatile values as placeholders (equal values share a number, numbered from
    ``base`` + 1 in order of appearance), and whether a learned template matched. The listed patterns
    go first (leftmost match wins; a match touching a placeholder already there is left alone); the
    first template that matches what is left then takes its spans."""
    kept = [m.span() for m in PLACEHOLDER_RE.finditer(text)] if _PLACEHOLDER in text else []

    def number(value: str) -> str:
        return PLACEHOLDER.format(values.setdefault(value, base + len(values) + 1))

    def swap(m: re.Match[str]) -> str:
        raw = m.group(0)
        value = raw.strip()
        if not value or any(m.start() < b and a < m.end() for a, b in kept):
            return raw
        hit = (n for n, g in m.groupdict().items() if g is not None and n.startswith(_PREFIX))
        moved.append(Moved("pattern", next(hit, _PREFIX).removeprefix(_PREFIX) or "?", ""))
        lead = len(raw) - len(raw.lstrip())
        return raw[:lead] + number(value) + raw[lead + len(value) :]

    if regex is not None:
        text = regex.sub(swap, text)
    for template in templates:
        spans = template.match(text)
        if spans is None:
            continue
        pieces, pos = [], 0
        for (a, b), label in zip(spans, template.labels, strict=True):
            pieces += [text[pos:a], number(text[a:b])]
            moved.append(Moved("learned", template.id, label))
            pos = b
        return "".join(pieces) + text[pos:], True
    return text, False


class LearnConfig(Strict):
    """config.toml [canonicalize.learn]; defaults equal the file's."""

    enabled: StrictBool = Field(
        default=True, description="learn volatile spans of system prompts from traffic"
    )
    min_requests: StrictInt = Field(
        default=3, ge=2, description="different prompts that must fit a template before it is used"
    )
    min_changes: StrictInt = Field(
        default=2, ge=1, description="of them with another value than a span's most common one"
    )
    samples: StrictInt = Field(
        default=24, ge=1, description="recent distinct system prompts kept per tenant to learn from"
    )
    templates: StrictInt = Field(
        default=16, ge=1, description="learned templates kept per tenant (least recently matched dropped)"
    )
    tenants: StrictInt = Field(default=256, ge=1, description="tenants tracked (least recently seen dropped)")
    max_prompt_chars: StrictInt = Field(
        default=16000, ge=1, description="longer system prompts are not learned from"
    )
    max_value_chars: StrictInt = Field(
        default=64, ge=1, description="a learned value is at most this long, and on one line"
    )
    max_spans: StrictInt = Field(default=8, ge=1, description="learned spans per template")
    min_shared: StrictFloat = Field(
        default=0.8,
        ge=0.5,
        le=1,
        description="share of a prompt's characters that must be the template's constant text",
    )


@dataclass(frozen=True)
class Template:
    """A system prompt with its volatile spans abstracted: ``parts[0] v1 parts[1] ... vn parts[n]``."""

    id: str
    parts: tuple[str, ...]
    labels: tuple[str, ...]  # per span: the words just before it (logs and the dashboard)
    max_value_chars: int

    def match(self, text: str) -> list[tuple[int, int]] | None:
        """The spans of the values in ``text``, or None if it is not this template. Each literal is
        found leftmost after the value before it; values are non-empty, short, on one line and never
        hold a placeholder already moved."""
        first, last = self.parts[0], self.parts[-1]
        if not (text.startswith(first) and text.endswith(last)) or len(text) < len(first) + len(last):
            return None
        spans: list[tuple[int, int]] = []
        pos, n = len(first), len(self.parts) - 1
        for i in range(1, n + 1):
            if i == n:
                end = len(text) - len(last)
            else:
                end = text.find(self.parts[i], pos + 1, pos + self.max_value_chars + len(self.parts[i]))
            if end <= pos or not _is_value(text[pos:end], self.max_value_chars):
                return None
            spans.append((pos, end))
            pos = end + len(self.parts[i])
        return spans

    @classmethod
    def of(cls, parts: tuple[str, ...], max_value_chars: int) -> Template:
        """The template of these constant parts; its id is their digest, so every replica that learns
        it (or reads it back from the database) names it alike."""
        digest = hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:10]
        return cls(digest, parts, tuple(_label(p) for p in parts[:-1]), max_value_chars)

    @property
    def size(self) -> int:
        return sum(map(len, self.parts))


def _is_value(value: str, max_chars: int) -> bool:
    return (
        0 < len(value) <= max_chars
        and "\n" not in value
        and _PLACEHOLDER not in value
        and value.strip() == value
        and bool(value.strip())
    )


def _pieces(pattern: re.Pattern[str], text: str) -> tuple[list[str], list[int]]:
    """Tokens and their start offsets (plus the end)."""
    toks = pattern.findall(text)
    offsets = [0]
    for t in toks:
        offsets.append(offsets[-1] + len(t))
    return toks, offsets


def differences(x: str, s: str, cfg: LearnConfig) -> list[tuple[int, int]] | None:
    """The spans of ``x`` whose text differs from ``s``, or None if the two are not one template.

    A diff over sentences (few and rarely repeated, so it is fast on long prompts), then over chunks (a
    word with its punctuation and the spaces after it) inside the sentences that differ, then over
    word tokens ("session=9f2c," against "session=a81b," keeps "session=" and "," constant). Text added
    or dropped, a long or multi-line difference, or differing sentences making up half of either
    prompt mean another template."""
    if not cfg.min_shared * len(x) <= len(s) <= len(x) / cfg.min_shared:
        return None
    spans: list[tuple[int, int]] = []
    return spans if _diff(x, 0, len(x), s, 0, len(s), 0, cfg, spans) else None


def _diff(
    x: str,
    xa: int,
    xb: int,
    s: str,
    sa: int,
    sb: int,
    level: int,
    cfg: LearnConfig,
    out: list[tuple[int, int]],
) -> bool:
    """Adds to ``out`` the spans of ``x[xa:xb]`` differing from ``s[sa:sb]`` at ``_LEVELS[level]`` and
    finer; False if they cannot be values."""
    left, lo = _pieces(_LEVELS[level], x[xa:xb])
    right, ro = _pieces(_LEVELS[level], s[sa:sb])
    ops = [op for op in SequenceMatcher(None, left, right, autojunk=False).get_opcodes() if op[0] != "equal"]
    if level == 0 and (
        sum(lo[i2] - lo[i1] for _, i1, i2, _, _ in ops) * 2 > xb - xa
        or sum(ro[j2] - ro[j1] for _, _, _, j1, j2 in ops) * 2 > sb - sa
    ):
        return False
    if level > 0 and any(i1 == i2 or j1 == j2 for _, i1, i2, j1, j2 in ops):
        # a piece added or dropped inside a changed region is a spurious alignment of short values
        # ("129.146.150.190" against "139.50.90.150" pairs the two 150s): one value, the region
        # without the word tokens it shares at either end
        return _trimmed(x, xa, xb, s, sa, sb, cfg, out)
    for _, i1, i2, j1, j2 in ops:
        a1, a2, b1, b2 = xa + lo[i1], xa + lo[i2], sa + ro[j1], sa + ro[j2]
        if level + 1 < len(_LEVELS):
            if a1 == a2 or b1 == b2 or not _diff(x, a1, a2, s, b1, b2, level + 1, cfg, out):
                return False
        elif _is_value(x[a1:a2], cfg.max_value_chars) and _is_value(s[b1:b2], cfg.max_value_chars):
            out.append((a1, a2))
        else:
            return False
    return True


def _trimmed(
    x: str, xa: int, xb: int, s: str, sa: int, sb: int, cfg: LearnConfig, out: list[tuple[int, int]]
) -> bool:
    left, right = _TOKEN.findall(x[xa:xb]), _TOKEN.findall(s[sa:sb])
    while left and right and left[0] == right[0]:
        xa, sa = xa + len(left.pop(0)), sa + len(right.pop(0))
    while left and right and left[-1] == right[-1]:
        xb, sb = xb - len(left.pop()), sb - len(right.pop())
    if not (_is_value(x[xa:xb], cfg.max_value_chars) and _is_value(s[sa:sb], cfg.max_value_chars)):
        return False
    out.append((xa, xb))
    return True


def _union(x: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping spans, and spans apart by spaces or punctuation on one line ("Tuesday 3pm"), as one."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and (a <= out[-1][1] or _joins(x[out[-1][1] : a])):
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return out


def _joins(between: str) -> bool:
    return not _WORD.search(between) and "\n" not in between


def _template(x: str, spans: list[tuple[int, int]], cfg: LearnConfig) -> Template | None:
    """``x`` with ``spans`` abstracted; None unless each span has a word of constant text on both
    sides (or the prompt's start or end) and the constant text is most of the prompt."""
    if not spans or len(spans) > cfg.max_spans:
        return None
    cuts = [0, *(p for span in spans for p in span), len(x)]
    parts = tuple(x[cuts[i] : cuts[i + 1]] for i in range(0, len(cuts), 2))
    if any(not _WORD.search(p) for p in parts[1:-1]) or sum(map(len, parts)) < cfg.min_shared * len(x):
        return None
    return Template.of(parts, cfg.max_value_chars)


def _label(left: str) -> str:
    """The words just before a value in its sentence: what it is ("Customer tier:")."""
    line = re.split(r"\n|[.!?]\s", left)[-1].strip()
    return line[-32:] if line else "(start)"


def values_of(template: Template, text: str) -> list[str] | None:
    spans = template.match(text)
    return None if spans is None else [text[a:b] for a, b in spans]


def learn(text: str, samples: Sequence[str], cfg: LearnConfig) -> Template | None:
    """A template for ``text`` learned from recent prompts of the same tenant, or None.

    The most similar prompts join one at a time; one joins only if every prompt joined so far still
    fits the template with it. A span where fewer than ``min_changes`` prompts have a value other than
    its most common one is made constant again (the prompts with another value there are left out),
    so a one-off variant never becomes a volatile span."""
    if not 16 <= len(text) <= cfg.max_prompt_chars:
        return None
    near: list[tuple[int, str, list[tuple[int, int]]]] = []
    for s in samples:
        if s != text and len(s) <= cfg.max_prompt_chars:
            spans = differences(text, s, cfg)
            if spans:
                near.append((sum(b - a for a, b in spans), s, spans))
    near.sort(key=lambda n: n[0])
    pool = [(s, spans) for _, s, spans in near]
    while len(pool) + 1 >= cfg.min_requests:
        found = _grow(text, pool, cfg)
        if found is None:
            return None
        template, joined, rows = found  # rows[0]: this prompt's values, then each joined one's
        thin = [i for i in range(len(rows[0])) if _changes([r[i] for r in rows]) < cfg.min_changes]
        if not thin:
            return template
        # leave out the prompts with another value in a thin span; that span becomes constant
        kept = [p for p, r in zip(joined, rows[1:], strict=True) if all(r[i] == rows[0][i] for i in thin)]
        if len(kept) == len(pool):
            return None
        pool = kept
    return None


def _changes(values: list[str]) -> int:
    """How many values differ from the most common one."""
    return len(values) - max(values.count(v) for v in set(values))


def _grow(
    text: str, pool: list[tuple[str, list[tuple[int, int]]]], cfg: LearnConfig
) -> tuple[Template, list[tuple[str, list[tuple[int, int]]]], list[list[str]]] | None:
    """The template of ``text`` over the pool prompts that joined it, those prompts, and the values of
    ``text`` then of each of them."""
    spans: list[tuple[int, int]] = []
    joined: list[tuple[str, list[tuple[int, int]]]] = []
    template: Template | None = None
    for s, own in pool:
        candidate = _template(text, _union(text, spans + own), cfg)
        if candidate is not None and all(
            candidate.match(m) is not None for m in (text, *(j[0] for j in joined), s)
        ):
            spans, template = spans + own, candidate
            joined.append((s, own))
    if template is None or len(joined) + 1 < cfg.min_requests:
        return None
    return template, joined, [values_of(template, m) or [] for m in (text, *(j[0] for j in joined))]
