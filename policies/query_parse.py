"""One query read once for the verifier's guards and features: words, content words, numbers and
amounts with their units, named entities, question word, persons, times, script (stdlib only).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache

from cachegw.policies.quantities import quantities

_WORD_RE = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_SEQ_RE = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[,&/]")
# Words that join symmetric conjuncts: "Java or Python" and "Python or Java" ask the same question.
COORDINATORS = frozenset({"and", "or", "nor", "vs", "versus", "v", "&", ",", "/"})
ARTICLES = frozenset({"a", "an", "the"})
_RAW_WORD_RE = re.compile(r"[A-Za-z][A-Za-z0-9'&.-]*[A-Za-z0-9]|[A-Za-z]")
_NUMBER_RE = re.compile(r"\d+(?:[.,]\d+)*")
# Idioms that contain a negation word without negating the question ("why or why not?", "not only").
_NEUTRAL_NEG_RE = re.compile(r"\b(?:or (?:why )?not|if not|not only|no matter|no doubt|not sure)\b")
_ARITH_RE = re.compile(r"\d\s*([-+*/^x×÷%=])\s*\d")
_NEGATION_RE = re.compile(
    r"\b(?:not|no|never|nobody|nothing|none|neither|nor|nowhere|without|cannot|cant|dont|doesnt|"
    r"didnt|isnt|arent|wasnt|werent|wont|wouldnt|shouldnt|couldnt|hasnt|havent|hadnt|aint)\b|n't\b"
)

# "one" is left out on purpose: it is mostly a pronoun ("which one", "no one", "one of the").
_NUMBER_WORDS: dict[str, int] = {
    w: i
    for i, w in enumerate(
        "zero _ two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen twenty".split()
    )
    if w != "_"
}
_NUMBER_WORDS.update({"thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80})
_NUMBER_WORDS.update({"ninety": 90, "hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9})
_NUMBER_WORDS.update({"first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "tenth": 10})

_WH_WORDS = ("what", "how", "why", "which", "who", "whom", "whose", "when", "where")
WH_SLOTS = ("what", "how", "why", "which", "who", "when", "where", "")
# Grammatical person: QQP annotators treat "how often do you exercise" and "... should I" as different.
_PERSONS = (
    frozenset({"i", "me", "my", "mine", "myself", "i'm", "i've", "i'd", "i'll"}),
    frozenset({"you", "your", "yours", "yourself", "you're", "you've", "you'd", "you'll"}),
    frozenset({"we", "us", "our", "ours", "ourselves", "we're", "we've"}),
)

STOPWORDS = frozenset(
    """a an the of to in on at for from by with about as into over under and or but if then than so
    is are was were be been being am do does did doing have has had having will would shall should can
    could may might must i me my mine we us our you your he him his she her it its they them their this
    that these those there here what how why which who whom whose when where some any all each every
    very much many more most also just only really ever get got make best good way ways one someone
    thing things quora""".split()
)

# Opposite pairs seen among QQP hard negatives; one side present without the other flips the question.

_WEEKDAYS = {d: d for d in "monday tuesday wednesday thursday friday saturday sunday".split()}
_WEEKDAYS.update({d + "s": d for d in list(_WEEKDAYS)})
_MONTHS = frozenset(
    "january february march april may june july august september october november december".split()
)
# "may" and "march" are ordinary words too ("may I", "the march"): months only after these or by a number.
_MONTH_CUES = frozenset(
    {"in", "of", "since", "until", "till", "from", "during", "early", "mid", "late", "last", "next"}
)
_RELATIVE_DAYS = frozenset({"today", "tomorrow", "yesterday", "tonight"})
_RELATIVE_MODS = {"this": "this", "current": "this", "last": "last", "past": "last", "previous": "last"}
_RELATIVE_MODS.update({"next": "next", "coming": "next", "upcoming": "next"})
# "day" is left out: "to this day" means "still".
_RELATIVE_UNITS = frozenset(
    "year years month week weekend season semester quarter decade century night".split()
)


@dataclass(frozen=True)
class ParsedQuery:
    """Everything the features need from one query, computed once per text."""

    tokens: tuple[str, ...]
    token_set: frozenset[str]
    content: frozenset[str]
    numbers: tuple[str, ...]  # numbers with units as values in base units ("5 km" -> "5000 meter")
    digits: tuple[str, ...]  # the same numbers as digit strings, units ignored (the guard before units)
    amounts: tuple[tuple[str, str], ...]  # (digits, amount) of the numbers written with a unit
    arith_ops: frozenset[str]
    negated: bool
    wh: str
    entities: frozenset[str]
    trigrams: frozenset[str]
    n_chars: int
    persons: tuple[bool, ...]
    n_questions: int
    foreign: str  # letters outside the Latin script, in order
    seq: tuple[str, ...]  # words with plural -s dropped, plus "," "&" "/", in order (for the swap guard)
    times: tuple[frozenset[str], frozenset[str], frozenset[str]]  # weekdays, months, relative times


_IS_CONTRACTION_RE = re.compile(r"\b(what|how|who|where|when|why|which|that|there|it|he|she)'s\b")


def _norm(text: str) -> str:
    """Lowercase, straight apostrophes, and "what's" -> "what is" so question words line up."""
    lower = text.lower().replace("\u2019", "'").replace("`", "'")
    return _IS_CONTRACTION_RE.sub(r"\1 is", lower)


def _singular(word: str) -> str:
    """Crude plural stripping, enough to line up "Muslims" with "Muslim" for the swap guard."""
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def _canon_number(digits: str) -> str:
    return digits.replace(",", "").rstrip(".").lstrip("0") or "0"


def _digits(lower: str, tokens: tuple[str, ...]) -> tuple[str, ...]:
    """Numbers as canonical strings: digits with separators dropped, plus spelled-out number words."""
    vals = [_canon_number(m) for m in _NUMBER_RE.findall(lower)]
    vals += [str(_NUMBER_WORDS[t]) for t in tokens if t in _NUMBER_WORDS]
    return tuple(sorted(vals))


def _numbers(text: str, digits: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """``digits`` with each number that carries a unit, a currency or a scale word replaced by its
    amount ("5 km" and "5000 m": "5000 meter"), and those numbers as (digits, amount) pairs."""
    amounts = tuple((_canon_number(raw), amount) for raw, amount in quantities(text))
    vals = list(digits)
    for raw, _ in amounts:
        if raw in vals:
            vals.remove(raw)
    return tuple(sorted(vals + [amount for _, amount in amounts])), amounts


def _entities(text: str) -> frozenset[str]:
    """Capitalized or all-caps words past the first word: a cheap proxy for named entities."""
    words = _RAW_WORD_RE.findall(text)
    out = set()
    for i, w in enumerate(words):
        if i == 0 or w == "I" or w.lower() in STOPWORDS:
            continue
        if w[0].isupper() or (len(w) > 1 and w.isupper()):
            out.add(w.lower().strip(".'"))
    return frozenset(out)


def windows(tokens: tuple[str, ...]) -> zip[tuple[str, str, str]]:
    """(previous, word, next) for each word; "" before the first and after the last."""
    padded = ("", *tokens, "")
    return zip(padded, padded[1:], padded[2:], strict=False)


def _times(tokens: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """Weekday names, month names and relative times ("today", "last year" = "past year") of a query."""
    weekdays = frozenset(_WEEKDAYS[t] for t in tokens if t in _WEEKDAYS)
    months: set[str] = set()
    relative = set(_RELATIVE_DAYS.intersection(tokens))
    for prev, t, nxt in windows(tokens):
        if t in _MONTHS and (
            t not in ("may", "march") or prev in _MONTH_CUES or prev[:1].isdigit() or nxt[:1].isdigit()
        ):
            months.add(t)
        if t in _RELATIVE_MODS and nxt in _RELATIVE_UNITS:
            relative.add(f"{_RELATIVE_MODS[t]} {nxt.removesuffix('s')}")
    return weekdays, frozenset(months), frozenset(relative)


@lru_cache(maxsize=65536)
def parse(text: str) -> ParsedQuery:
    """Tokenize and extract the guard-relevant facts of one query (cached: stored queries repeat)."""
    lower = _norm(text)
    tokens = tuple(_WORD_RE.findall(lower))
    squashed = " ".join(tokens)
    first_wh = next((t for t in tokens if t in _WH_WORDS), "")
    digits = _digits(lower, tokens)
    numbers, amounts = _numbers(text, digits)
    return ParsedQuery(
        tokens=tokens,
        token_set=frozenset(tokens),
        content=frozenset(t for t in tokens if t not in STOPWORDS),
        numbers=numbers,
        digits=digits,
        amounts=amounts,
        arith_ops=frozenset(_ARITH_RE.findall(lower)),
        negated=bool(_NEGATION_RE.search(_NEUTRAL_NEG_RE.sub(" ", lower))),
        wh=first_wh,
        entities=_entities(text.replace("\u2019", "'")),
        trigrams=frozenset(squashed[i : i + 3] for i in range(max(len(squashed) - 2, 1))),
        n_chars=len(squashed),
        persons=tuple(bool(p & set(tokens)) for p in _PERSONS),
        n_questions=text.count("?"),
        foreign=_foreign_letters(text),
        seq=tuple(_singular(t) for t in _SEQ_RE.findall(lower)),
        times=_times(tokens),
    )


@lru_cache(maxsize=4096)
def _is_latin(ch: str) -> bool:
    return unicodedata.name(ch, "").startswith("LATIN")


def _foreign_letters(text: str) -> str:
    """MiniLM is an English model: words of other scripts often become the same [UNK] token, so two
    different Chinese questions can embed identically (cosine 1.0 on QQP). Such letters must match."""
    return "".join(ch for ch in unicodedata.normalize("NFC", text) if ch.isalpha() and not _is_latin(ch))
