"""The alignment that makes a semantic hit account for every difference (policies/pair_diff.py), on the
shapes of the families in bench/data/verifier_families.jsonl, each checked in both orders. Pure policy:
no model is loaded. Every refusal here was a possible hit before: the old tier compared only the
cosine of the first 256 word pieces and the verifier's guards."""

from __future__ import annotations

import pytest

from cachegw.policies.message_parts import split_message
from cachegw.policies.opposites import opposite
from cachegw.policies.pair_diff import align
from cachegw.policies.pair_guards import guard_reason

REPORT = (
    "Quarterly sales in the northern region were flat compared with last year, while the southern region "
    "grew strongly thanks to two new distribution partners. Returns increased for the premium headphone "
    "line after a firmware update caused connection drops; a fix was released in the last week of the "
    "quarter. Marketing spend was cut in the west, and sales there fell slightly. Inventory levels are "
    "healthy except for the budget speakers, which are close to selling out."
)
LONG = "\n\n".join([REPORT] * 12)  # ~900 words: far past the encoder's 256 word pieces
CODE = "```python\ndef is_adult(age):\n    return age >= 18\n```"


def both(a: str, b: str) -> tuple:
    """The alignment's verdict in both orders, as (outcome, reason); they must agree."""
    x, y = align(a, b), align(b, a)
    assert (x.outcome, x.reason) == (y.outcome, y.reason)
    return x.outcome, x.reason


@pytest.mark.parametrize("layout", ["{d}\n\n{q}", "{q}\n\n{d}", "{d} {q}"])
def test_an_instruction_over_the_same_document_is_judged_alone(layout: str) -> None:
    a = layout.format(d=REPORT, q="Summarize this in one sentence.")
    b = layout.format(d=REPORT, q="Translate this into French.")
    al = align(a, b)
    assert (al.outcome, al.focus_new, al.focus_old) == (
        "judge",
        "Summarize this in one sentence.",
        "Translate this into French.",
    )
    assert al.reembed  # the focus is embedded alone: the whole texts' cosine is ~1.0
    assert align(b, a).focus_new == "Translate this into French."


def test_a_changed_document_is_a_miss_whatever_the_instruction() -> None:
    edited = REPORT.replace("two new distribution partners", "three new distribution partners")
    assert both(f"{REPORT}\n\nSummarize.", f"{edited}\n\nSummarize.") == ("refuse", "context-differs")
    quoted = "> I can't make Tuesday, sorry.\n\nWrite a polite reply."
    other = "> I can make Tuesday, see you.\n\nWrite a polite reply."
    assert both(quoted, other) == ("refuse", "context-differs")


def test_long_messages_that_differ_only_in_their_last_line() -> None:
    """The encoder reads the first 256 word pieces: these two embed identically (cosine 1.0)."""
    al = align(f"{LONG}\n\nWhat is the main risk?", f"{LONG}\n\nWho are the new partners?")
    assert (al.outcome, al.focus_new, al.focus_old) == (
        "judge",
        "What is the main risk?",
        "Who are the new partners?",
    )
    middle = LONG.replace("fell slightly", "rose slightly", 1)
    assert both(f"{LONG}\n\nSummarize.", f"{middle}\n\nSummarize.") == ("refuse", "context-differs")


@pytest.mark.parametrize(
    "old,new",
    [(">=", ">"), ("18", "21"), ("age >= 18", "age >= 18 and age < 65"), ("is_adult", "is_minor")],
)
def test_code_that_differs_in_one_token_is_a_miss(old: str, new: str) -> None:
    q = "Why does this code not work?"
    assert both(f"{q}\n\n{CODE}", f"{q}\n\n{CODE.replace(old, new)}") == ("refuse", "guard:code")
    raw = "def is_adult(age):\n    return age >= 18"
    assert both(f"{raw}\n\n{q}", f"{raw.replace(old, new)}\n\n{q}") == ("refuse", "guard:code")


def test_code_that_differs_only_in_whitespace_leaves_the_question_to_judge() -> None:
    spaced = CODE.replace("return age >= 18", "return  age  >=  18")
    al = align(f"What does this do?\n\n{CODE}", f"What does this code do?\n\n{spaced}")
    assert (al.outcome, al.focus_new, al.focus_old) == (
        "judge",
        "What does this do?",
        "What does this code do?",
    )


@pytest.mark.parametrize(
    "a,b",
    [
        ("What does x += 1 do?", "What does x -= 1 do?"),
        ("How do I use os.path.join?", "How do I use os.path.split?"),
        ("Is 2+2=4?", "Is 2*2=4?"),
        ("What does `git reset --soft` do?", "What does `git reset --hard` do?"),
        ("df = df.sort_values('price')", "df = df.sort_values('date')"),
    ],
)
def test_inline_code_and_operators_match_exactly(a: str, b: str) -> None:
    assert both(a, b) == ("refuse", "guard:code")


@pytest.mark.parametrize(
    "a,b",
    [
        ("Is it safe to eat raw cookie dough?", "Is it dangerous to eat raw cookie dough?"),
        ("Is coffee good for your heart?", "Is coffee bad for your heart?"),
        ("Is the museum open on public holidays?", "Is the museum closed on public holidays?"),
        ("Is Rust harder to learn than Go?", "Is Rust easier to learn than Go?"),
        ("Do cats like being picked up?", "Do cats dislike being picked up?"),
    ],
)
def test_a_yes_no_question_flipped_by_an_opposite_word(a: str, b: str) -> None:
    assert both(a, b) == ("refuse", "guard:polarity")


@pytest.mark.parametrize(
    "a,b",
    [
        ("turn on the kitchen lights", "turn off the kitchen lights"),
        ("turn the tv volume up", "turn the tv volume down"),
        ("increase the volume on the speaker", "decrease the volume on the speaker"),
        ("lock the front door", "unlock the front door"),
        ("mute the tv", "unmute the tv"),
        ("connect the vacuum to wifi", "disconnect the vacuum from wifi"),
    ],
)
def test_opposite_device_actions(a: str, b: str) -> None:
    assert both(a, b) == ("refuse", "guard:polarity")


def test_opposites_come_from_the_lexicon_with_inflections() -> None:
    assert opposite("increases", "decreases") and opposite("better", "worse") and opposite("on", "off")
    assert not opposite("big", "large") and not opposite("reset", "resets") and not opposite("cat", "dog")


@pytest.mark.parametrize(
    "a,b,reason",
    [
        ("How long does it take to walk 5 km?", "How long does it take to walk 5 miles?", "units"),
        ("Set a timer for 10 minutes.", "Set a timer for 10 hours.", "units"),
        ("Is 30°C warm for a pool?", "Is 30°F warm for a pool?", "units"),
        ("How long does it take to walk 5 km?", "How long does it take to walk 5 kilometres?", None),
        ("How long does it take to walk 5 km?", "How long does it take to walk 5000 m?", None),
        ("Is a 2 kg laptop heavy?", "Is a 2000 g laptop heavy?", None),
        ("Does it cost $20?", "Does it cost 20 dollars?", None),
        ("Best phone under 15000 rupees?", "Best phone under 20,000 rupees?", "numbers"),
    ],
)
def test_numbers_with_units_are_compared_as_values(a: str, b: str, reason: str | None) -> None:
    assert guard_reason(a, b) == reason and guard_reason(b, a) == reason


@pytest.mark.parametrize(
    "a,b",
    [
        ("How do I reset my password?", "How can I reset my password?"),
        ("What is the capital of Australia?", "Which city is the capital of Australia?"),
        ("Why is the U.S. so rich?", "Why is the US so rich?"),
        ("How can I learn C++?", "What is the best way to learn C++?"),
    ],
)
def test_a_plain_paraphrase_is_left_whole_to_the_verifier(a: str, b: str) -> None:
    al = align(a, b)
    assert (al.outcome, al.focus_new, al.focus_old, al.reembed) == ("judge", a, b, False)


def test_whitespace_only_differences_are_the_same_request() -> None:
    assert both(f"{LONG}\n\nSummarize  this.", f"{LONG}\n\n Summarize this.\n") == ("same", "")


def test_message_blocks() -> None:
    kinds = [b.kind for b in split_message(f"Here is my code:\n\n{CODE}\n\nWhy does it fail?")]
    assert kinds == ["text", "code", "text"]
    assert [b.kind for b in split_message(f"Summarize the following: {REPORT}")] == ["text", "doc"]
    assert [b.kind for b in split_message("Is 2+2=4?")] == ["text"]
