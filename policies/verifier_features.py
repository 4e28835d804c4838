"""Pair features and hard guards for the semantic-cache verifier (numpy + stdlib only).

Cosine similarity of MiniLM embeddings is blind to the few tokens that change an answer: a number,
a negation, a named entity. The guards veto those pairs outright; the lexical features let the learned
classifier weigh softer differences (question word, unshared content words, character overlap).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from difflib import SequenceMatcher
from functools import lru_cache

import numpy as np

from policies.quantities import quantities

_WORD_RE = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_SEQ_RE = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[,&/]")
# Words that join symmetric conjuncts: "Java or Python" and "Python or Java" ask the same question.
_COORDINATORS = frozenset({"and", "or", "nor", "vs", "versus", "v", "&", ",", "/"})
_ARTICLES = frozenset({"a", "an", "the"})
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
_WH_SLOTS = ("what", "how", "why", "which", "who", "when", "where", "")
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
_ANTONYMS: tuple[tuple[str, str], ...] = (
    ("best", "worst"),
    ("advantages", "disadvantages"),
    ("pros", "cons"),
    ("before", "after"),
    ("increase", "decrease"),
    ("buy", "sell"),
    ("male", "female"),
    ("men", "women"),
    ("boy", "girl"),
    ("boys", "girls"),
    ("husband", "wife"),
    ("boyfriend", "girlfriend"),
    ("he", "she"),
    ("start", "stop"),
    ("win", "lose"),
    ("rich", "poor"),
    ("positive", "negative"),
    ("import", "export"),
    ("upload", "download"),
    ("love", "hate"),
    ("gain", "lose"),
    ("legal", "illegal"),
    ("possible", "impossible"),
    ("good", "bad"),
    # From an audit of accepted pairs. QQP rarely has these above the 0.88 cosine floor; the ones it
    # has are real flips ("high / low blood sugar", "son / daughter") except where noted in verifier.md.
    # Comparatives and extremes: "less than 100 million" / "more than", "ascending / descending order".
    ("more", "less"),
    ("more", "fewer"),
    ("greater", "less"),
    ("greater", "smaller"),
    ("higher", "lower"),
    ("larger", "smaller"),
    ("bigger", "smaller"),
    ("high", "low"),
    ("most", "least"),
    ("highest", "lowest"),
    ("largest", "smallest"),
    ("maximum", "minimum"),
    ("max", "min"),
    ("ascending", "descending"),
    ("increasing", "decreasing"),
    ("too much", "too little"),  # a phrase: "much" / "little" alone fired on a QQP paraphrase
    # States and actions: "unable / able to connect", "send / receive an email", "script slow / fast".
    ("able", "unable"),
    ("slow", "fast"),
    ("slower", "faster"),
    ("send", "receive"),
    ("encrypt", "decrypt"),
    ("install", "uninstall"),
    ("enable", "disable"),
    ("add", "remove"),
    ("open", "close"),
    ("push", "pull"),
    # Places, family, seasons.
    ("inside", "outside"),
    ("above", "below"),
    ("north", "south"),
    ("east", "west"),
    ("left", "right"),
    ("mother", "father"),
    ("son", "daughter"),
    ("brother", "sister"),
    ("summer", "winter"),
    ("during", "after"),
)
_ANTONYM_PHRASES = tuple((x, y) for x, y in _ANTONYMS if " " in x or " " in y)
_NONE: frozenset[str] = frozenset()


def _opposites() -> dict[str, frozenset[str]]:
    """Each single word of ``_ANTONYMS`` with all its opposites ("lose": win, gain), both ways."""
    out: dict[str, frozenset[str]] = {}
    for x, y in _ANTONYMS:
        if (x, y) not in _ANTONYM_PHRASES:
            out[x], out[y] = out.get(x, _NONE) | {y}, out.get(y, _NONE) | {x}
    return out


_OPPOSITES = _opposites()

# Particles are too common to flip on their own ("smell in carpets" / "smell out of my carpet" is one
# question): they count only between the same two words, "zoom in on" / "zoom out on" (so "log in to" /
# "log out of" is missed).
_PARTICLES: tuple[tuple[str, str], ...] = (("in", "out"), ("up", "down"), ("on", "off"))

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


def _amounts_conflict(a: ParsedQuery, b: ParsedQuery) -> bool:
    """The same digits name other amounts on the two sides: "5 km" / "5 miles", "10 minutes" / "10
    hours". A unit written on one side only is not a conflict ("19 years" / "after 19")."""
    with_unit_a = [(r, x) for r, x in a.amounts if " " in x]  # "50k" alone names no unit
    with_unit_b = [(r, x) for r, x in b.amounts if " " in x]
    for raw in {r for r, _ in with_unit_a} & {r for r, _ in with_unit_b}:
        if {x for r, x in with_unit_a if r == raw} != {x for r, x in with_unit_b if r == raw}:
            return True
    return False


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


def _windows(tokens: tuple[str, ...]) -> zip[tuple[str, str, str]]:
    """(previous, word, next) for each word; "" before the first and after the last."""
    padded = ("", *tokens, "")
    return zip(padded, padded[1:], padded[2:], strict=False)


def _times(tokens: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """Weekday names, month names and relative times ("today", "last year" = "past year") of a query."""
    weekdays = frozenset(_WEEKDAYS[t] for t in tokens if t in _WEEKDAYS)
    months: set[str] = set()
    relative = set(_RELATIVE_DAYS.intersection(tokens))
    for prev, t, nxt in _windows(tokens):
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


def _entity_mismatch(a: ParsedQuery, b: ParsedQuery) -> int:
    """Entities of one side that the other side does not mention at all (any casing)."""
    return len(a.entities - b.token_set) + len(b.entities - a.token_set)


def _has(q: ParsedQuery, word: str) -> bool:
    """A word, or a phrase of words in a row ("too much")."""
    return word in q.token_set if " " not in word else f" {word} " in f" {' '.join(q.tokens)} "


def _contexts(q: ParsedQuery, word: str) -> set[tuple[str, str]]:
    """The (previous, next) word around each occurrence of ``word``."""
    return {(prev, nxt) for prev, t, nxt in _windows(q.tokens) if t == word}


def _antonym_flip(a: ParsedQuery, b: ParsedQuery) -> bool:
    """One side has a word and the other its opposite, but neither has both. A particle pair counts only
    where one side has "zoom in on" and the other "zoom out on" (same words either side)."""
    only_b = b.token_set - a.token_set
    for x in a.token_set - b.token_set:  # words are looked up, not scanned: this runs on every candidate
        if _OPPOSITES.get(x, _NONE) & only_b:
            return True
    for x, y in _ANTONYM_PHRASES:
        ax, ay, bx, by = _has(a, x), _has(a, y), _has(b, x), _has(b, y)
        if (ax and by and not bx and not ay) or (ay and bx and not by and not ax):
            return True
    for x, y in _PARTICLES:
        if not ((x in a.token_set and y in b.token_set) or (y in a.token_set and x in b.token_set)):
            continue
        ax, ay, bx, by = _contexts(a, x), _contexts(a, y), _contexts(b, x), _contexts(b, y)
        if ((ax - bx) & (by - ay)) or ((ay - by) & (bx - ax)):
            return True
    return False


def _time_conflict(a: ParsedQuery, b: ParsedQuery) -> bool:
    """Each side names a weekday, a month or a relative time ("last year", "tomorrow") that the other does
    not: "what day of the week is Monday" / "Tuesday", "super bowl last year" / "this year". Cosine barely
    moves for these. One side naming a time the other leaves out is not enough ("turn 20 in May" / "turn
    20 soon" is one QQP question). A number on either side (numbers must already match) fixes the date,
    so relative times are then not compared ("this season 2016-2017" / "next season 2016-2017")."""
    n = 2 if a.numbers or b.numbers else 3
    return any(x - y and y - x for x, y in zip(a.times[:n], b.times[:n], strict=True))


def _role_swap(a: ParsedQuery, b: ParsedQuery, min_overlap: float = 0.5) -> bool:
    """Two content words trade places around the same relation: "convert dollars to rupees" vs "rupees
    to dollars", "what do Croats think of Turks" vs the reverse. Cosine is near 1.0 for these and QQP
    labels them different (in the training split 7 of the 31 it vetoes at cosine >= 0.8 are duplicates).
    Words between that differ only by an article also count as the same ("convert an int to a string" /
    "a string to an int": overlap 1/3 with the articles). Words swapped across a coordinator ("Java or
    Python") are symmetric and pass.
    """

    def is_content(t: str) -> bool:
        return t not in STOPWORDS and t not in _COORDINATORS

    once = [t for t in dict.fromkeys(a.seq) if is_content(t) and a.seq.count(t) == 1 and b.seq.count(t) == 1]
    pos_a, pos_b = {t: a.seq.index(t) for t in once}, {t: b.seq.index(t) for t in once}
    for i, x in enumerate(once):
        for y in once[i + 1 :]:
            if (pos_a[x] - pos_a[y]) * (pos_b[x] - pos_b[y]) > 0:
                continue  # same order on both sides
            mid_a = set(a.seq[min(pos_a[x], pos_a[y]) + 1 : max(pos_a[x], pos_a[y])])
            mid_b = set(b.seq[min(pos_b[x], pos_b[y]) + 1 : max(pos_b[x], pos_b[y])])
            if not mid_a or not mid_b or mid_a & _COORDINATORS or mid_b & _COORDINATORS:
                continue  # adjacent words, or conjuncts of a symmetric list
            core_a, core_b = mid_a - _ARTICLES, mid_b - _ARTICLES
            if len(mid_a & mid_b) / len(mid_a | mid_b) >= min_overlap or (core_a and core_a == core_b):
                return True  # the words between them, the relation, stayed the same
    return False


GUARD_NAMES: tuple[str, ...] = ("numbers", "units", "negation", "antonym", "script", "swap", "time")


def guard_reason(q_a: str, q_b: str, units: bool = True) -> str | None:
    """Name of the first hard guard the pair violates, or None when no guard vetoes it. Numbers must
    match as digits or as amounts with their units, and the same digits must not name other amounts
    ("units"). ``units=False`` compares digits only, as before units were read (the bench's "before")."""
    a, b = parse(q_a), parse(q_b)
    if a.digits != b.digits and (not units or a.numbers != b.numbers):  # "5 km" = "5000 m"
        return "numbers"
    if units and a.digits == b.digits and _amounts_conflict(a, b):
        return "units"
    if a.arith_ops != b.arith_ops:
        return "numbers"
    if a.negated != b.negated:
        return "negation"
    if _antonym_flip(a, b):
        return "antonym"
    if a.foreign != b.foreign:
        return "script"
    if _role_swap(a, b):
        return "swap"
    if _time_conflict(a, b):
        return "time"
    return None


def _order_agreement(a: ParsedQuery, b: ParsedQuery) -> float:
    """Fraction of shared content-word pairs in the same order: low for "cats fear tigers" vs the swap."""
    first_b: dict[str, int] = {}
    for i, t in enumerate(b.tokens):
        first_b.setdefault(t, i)
    pos = [first_b[t] for t in dict.fromkeys(a.tokens) if t in b.content and t in a.content]
    n = len(pos)
    if n < 2:
        return 1.0
    concordant = sum(pos[i] < pos[j] for i in range(n) for j in range(i + 1, n))
    return concordant / (n * (n - 1) / 2)


def _jaccard(x: frozenset[str], y: frozenset[str]) -> float:
    union = len(x | y)
    return len(x & y) / union if union else 1.0


LEXICAL_NAMES: tuple[str, ...] = (
    "cosine",
    "token_jaccard",
    "content_jaccard",
    "content_overlap_min",
    "trigram_jaccard",
    "seq_ratio",
    "len_ratio",
    "content_only_min",
    "content_only_max",
    "same_wh",
    "wh_missing",
    "entity_mismatch",
    "entity_any",
    "has_numbers",
    "exact_tokens",
    "order_agreement",
    "person_i_differs",
    "person_you_differs",
    "person_we_differs",
    "question_marks_diff",
    *(f"wh_{w or 'none'}" for w in _WH_SLOTS),
)


def lexical_features(q_a: str, q_b: str, cosine: float) -> list[float]:
    """Symmetric hand-made features of one pair, in the order of ``LEXICAL_NAMES``."""
    a, b = parse(q_a), parse(q_b)
    only_a, only_b = len(a.content - b.content), len(b.content - a.content)
    inter = len(a.content & b.content)
    ent = _entity_mismatch(a, b)
    return [
        cosine,
        _jaccard(a.token_set, b.token_set),
        _jaccard(a.content, b.content),
        inter / max(min(len(a.content), len(b.content)), 1),
        _jaccard(a.trigrams, b.trigrams),
        SequenceMatcher(None, a.tokens, b.tokens, autojunk=False).ratio(),
        min(a.n_chars, b.n_chars) / max(a.n_chars, b.n_chars, 1),
        np.log1p(min(only_a, only_b)),
        np.log1p(max(only_a, only_b)),
        float(a.wh == b.wh),
        float((a.wh == "") != (b.wh == "")),
        np.log1p(ent),
        float(bool(a.entities or b.entities)),
        float(bool(a.numbers or b.numbers)),
        float(a.tokens == b.tokens),
        _order_agreement(a, b),
        *(float(x != y) for x, y in zip(a.persons, b.persons, strict=True)),
        float(min(abs(a.n_questions - b.n_questions), 3)),
        *(float(a.wh == w) + float(b.wh == w) for w in _WH_SLOTS),
    ]


def pair_features(q_new: list[str], q_old: list[str], emb_new: np.ndarray, emb_old: np.ndarray) -> np.ndarray:
    """Feature matrix [n, len(LEXICAL_NAMES) + 2*dim]: lexical features, then |u - v| and u * v."""
    u = np.asarray(emb_new, dtype=np.float32).reshape(len(q_new), -1)
    v = np.asarray(emb_old, dtype=np.float32).reshape(len(q_old), -1)
    cos = np.einsum("ij,ij->i", u, v)
    rows = [lexical_features(a, b, float(c)) for a, b, c in zip(q_new, q_old, cos, strict=True)]
    lex = np.array(rows, dtype=np.float32)
    return np.hstack([lex.reshape(len(q_new), len(LEXICAL_NAMES)), np.abs(u - v), u * v]).astype(np.float32)
