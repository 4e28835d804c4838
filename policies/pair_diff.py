"""Align two queries and account for every difference before a semantic hit is allowed.

Cosine over the first 256 word pieces cannot see a changed last line, a changed operator in a code block
or "turn on" against "turn off". Here the two messages are aligned (``difflib`` over their blocks, then
over the tokens of the blocks that differ), so everything outside the differing spans is known to be
identical and only those spans need a verdict:

1. Material (code, quotes, a document; ``policies/message_parts.py``) must match up to whitespace:
   otherwise ``guard:code`` (a code block differs) or ``context-differs``.
2. Where only instruction blocks differ, they are the *focus*: the learned verifier judges the two
   focus texts (re-embedded alone when material was set apart, so a paraphrased question over an
   identical document still hits). An instruction block has at most ``LONG_WORDS`` (60) words and only
   the first and the last block of a long message can be one, so the encoder always reads a focus whole.
3. Inside the focus, each differing token span is checked: code-like tokens (operators, identifiers,
   inline code) must match (``guard:code``), and a short substitution of a word by its opposite
   (WordNet antonyms, a negating prefix: ``policies/opposites.py``) is ``guard:polarity``.
   Numbers with units are compared as values by the verifier's guards (``guard:units``).

Pure and cheap: tokenization is cached per text; the alignment of two short queries takes tens of
microseconds, of two 1,500-word messages about a millisecond.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from difflib import SequenceMatcher
from functools import lru_cache

from cachegw.policies.message_parts import Block, split_message
from cachegw.policies.opposites import opposite
from cachegw.policies.quantities import warm as warm_units
from cachegw.policies.query_parse import STOPWORDS

_SPAN_MAX = 2  # a substitution of at most this many tokens a side is checked for opposites
_TOKEN_RE = re.compile(
    r"`[^`\n]+`"  # inline code, one token
    r"|[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)+(?:\(\))?"  # dotted names: os.path.join, a.b()
    r"|[A-Za-z_]\w*\(\)"  # calls: len()
    r"|\w+(?:'\w+)?"  # words and numbers
    r"|[+\-*/%=<>!&|^~]+"  # operators
)
_CAMEL_RE = re.compile(r"^[a-z]{2,}[A-Z][a-z]")  # getValue, not iPhone or eBay
_SNAKE_RE = re.compile(r"[A-Za-z0-9]_[A-Za-z0-9]")
_OPERATOR_RE = re.compile(r"^[+\-*/%=<>!&|^~]+$")
# Operators of the common languages; other runs of symbols in prose are punctuation or emoticons (":-/").
_OPERATORS = frozenset(
    "== != <= >= += -= *= /= %= -> => && || ** // << >> ++ ::= := === !== = < > | ^ ~".split()
)
_ARITHMETIC = frozenset("+ * % &".split())  # code only where the other side has another operator there
# Top-level domains: "quora.com" or "musical.ly" in a question is a name, not code.
_DOMAINS = frozenset("com org net io ly co uk in edu gov de fr me tv ai app".split())


@dataclass(frozen=True)
class Alignment:
    """What the alignment leaves to decide. ``outcome``: "same" (equal up to whitespace: a hit with no
    model call), "refuse" (``reason`` says why) or "judge" (the verifier reads the focus)."""

    outcome: str
    reason: str = ""
    focus_new: str = ""
    focus_old: str = ""
    reembed: bool = False  # the focus is not the whole text: its embedding must be computed


@lru_cache(maxsize=8192)
def _tokens(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(raw, compared) tokens: raw keeps case for code-likeness, compared is lowercase."""
    raw = tuple(_TOKEN_RE.findall(text))
    return raw, tuple(t.lower() if not t.startswith("`") else t for t in raw)


def _code_token(t: str) -> bool:
    """Inline code, an identifier (snake_case, camelCase, a call, a dotted name such as os.path.join but
    not "U.S.", "B.Tech" or "quora.com") or a two-character operator of a programming language."""
    if t.startswith("`") or t.endswith("()") or _CAMEL_RE.match(t) or _SNAKE_RE.search(t):
        return True
    if "." in t:  # os.path.join, df.sort_values; not "error.can" (a missing space) or "quora.com"
        parts = t.split(".")
        return parts[-1] not in _DOMAINS and (len(parts) > 2 or any(not p.isalpha() for p in parts))
    return t in _OPERATORS and len(t) > 1  # "x >= 1"; a lone "<" or "=" counts against another one


def span_reason(text_new: str, text_old: str) -> str:
    """The first guard a differing token span of two instruction texts violates, or ""."""
    raw_a, a = _tokens(text_new)
    raw_b, b = _tokens(text_old)
    for op, i1, i2, j1, j2 in SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        span_a, span_b = raw_a[i1:i2], raw_b[j1:j2]
        ops_a = [t for t in span_a if t in _OPERATORS or t in _ARITHMETIC]  # "+" / "*", not "!" / "-"
        ops_b = [t for t in span_b if t in _OPERATORS or t in _ARITHMETIC]
        if any(_code_token(t) for t in span_a + span_b) or (ops_a and ops_b and ops_a != ops_b):
            return "guard:code"
        if op == "replace" and len(span_a) <= _SPAN_MAX and len(span_b) <= _SPAN_MAX:
            if _flips(a[i1:i2], b[j1:j2]):
                return "guard:polarity"
    return ""


def _flips(span_a: tuple[str, ...], span_b: tuple[str, ...]) -> bool:
    """A word swapped for its opposite, with nothing else in the swap but function words ("cheaper" /
    "more expensive"): "my questions off Quora" / "my question on Quora" changes a content word too
    and is left to the verifier, as are two flips that cancel ("never" / "un-")."""
    for x in span_a:
        for y in span_b:
            if opposite(x, y):
                rest = [t for t in span_a if t != x] + [t for t in span_b if t != y]
                if all(t in STOPWORDS for t in rest):
                    return True
    return False


def warm() -> None:
    """Read the opposites lexicon and the unit registry now (about 2 s at start) rather than on the event
    loop during the first lookup."""
    opposite("on", "off")
    warm_units()


def _join(blocks: list[Block]) -> str:
    return "\n\n".join(b.text.strip() for b in blocks)


def align(q_new: str, q_old: str) -> Alignment:
    """Account for every difference between two user messages (see the module docstring)."""
    if q_new.split() == q_old.split():
        return Alignment("same")
    blocks_a, blocks_b = split_message(q_new), split_message(q_old)
    has_material = any(b.material for b in blocks_a + blocks_b)
    if not has_material and len(blocks_a) <= 1 and len(blocks_b) <= 1:
        focus_a, focus_b, reembed = q_new, q_old, False
    else:
        keys_a, keys_b = [b.key for b in blocks_a], [b.key for b in blocks_b]
        diff_a: list[Block] = []
        diff_b: list[Block] = []
        for op, i1, i2, j1, j2 in SequenceMatcher(None, keys_a, keys_b, autojunk=False).get_opcodes():
            if op == "equal":
                continue
            changed = blocks_a[i1:i2] + blocks_b[j1:j2]
            if any(b.kind == "code" for b in changed):
                return Alignment("refuse", "guard:code")
            if any(b.material for b in changed):
                return Alignment("refuse", "context-differs")
            diff_a += blocks_a[i1:i2]
            diff_b += blocks_b[j1:j2]
        if not diff_a or not diff_b:  # an instruction only one side gives
            return Alignment("refuse", "context-differs")
        whole = not has_material and len(diff_a) == len(blocks_a) and len(diff_b) == len(blocks_b)
        focus_a, focus_b, reembed = _join(diff_a), _join(diff_b), not whole
        if whole:
            focus_a, focus_b = q_new, q_old
    reason = span_reason(focus_a, focus_b)
    if reason:
        return Alignment("refuse", reason)
    return Alignment("judge", "", focus_a, focus_b, reembed)
