"""Volatile values: listed patterns match case-insensitively, and spans in other forms are learned from a
tenant's traffic (pure policy and the gateway's bounded per-tenant state). Pure Python, a few seconds."""

from __future__ import annotations

import random
from typing import TypeVar

import pytest

from cachegw.gateway.request.volatile_learner import VolatileLearner
from cachegw.policies.cache_keys import request_keys
from cachegw.policies.canonicalize import canonicalize, canonicalize_detail
from cachegw.policies.canonicalize_config import CanonicalizeConfig
from cachegw.policies.volatile import LearnConfig, differences, learn

M = TypeVar("M", LearnConfig, CanonicalizeConfig)

CFG = CanonicalizeConfig()
LEARN = LearnConfig()


def replace(config: M, **changes: object) -> M:
    return config.model_copy(update=changes)


POLICY = (
    "You are the assistant of a small online shop. Answer questions about orders, returns and "
    "shipping. Be brief and polite, never invent an order status, and ask for the order number when "
    "it is missing. Refunds take five working days. Escalate legal questions to a human agent. "
)
TEMPLATE = (
    "Customer tier: {tier}\nsession={session}\nuser_name: {name}\n\n"
    + (POLICY * 3).strip()
    + "\nIt's {day} {hour}pm where the customer is. Kontonummer {account}."
)
TIERS, NAMES = ["GOLD", "SILVER", "BRONZE", "PLATINUM"], ["alice", "bob", "carol", "dave"]
DAYS = ["Tuesday", "Friday"]


def prompt(rng: random.Random, **fixed: object) -> str:
    values = {
        "tier": rng.choice(TIERS),
        "session": f"{rng.getrandbits(48):012x}",
        "name": rng.choice(NAMES),
        "day": rng.choice(DAYS),
        "hour": rng.randint(1, 12),
        "account": rng.randint(1000, 99999),
    }
    return TEMPLATE.format(**{**values, **fixed})


def varied(seed: int, n: int = 4) -> list[str]:
    """Prompts of one template whose tier, name and hour all differ (the day stays Tuesday)."""
    rng = random.Random(seed)
    return [prompt(rng, tier=TIERS[i], name=NAMES[i], day="Tuesday", hour=i + 1) for i in range(n)]


def body(system: str, question: str = "Where is my parcel?") -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "m", "messages": messages}


def feed(learner: VolatileLearner, tenant: str, texts: list[str], cfg: LearnConfig = LEARN) -> list[bool]:
    return [learner.observe(tenant, [t], cfg) for t in texts]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("SESSION-ID: 9f2c1a", "Session_Id=77ab"),
        ("MONDAY, NOV 22 2026", "tuesday, dec 1"),
        ("10:30 pm", "11:45 Pm"),
    ],
)
def test_listed_patterns_match_in_any_case(a: str, b: str) -> None:
    """Upper- or mixed-case forms of the listed patterns are moved (the old, case-sensitive
    alternation left them in the prompt)."""
    template = "Be brief.\nNow: {} (as given).\n" + " ".join(["Stable policy text."] * 10)
    out_a, rules = canonicalize(body(template.format(a)), CFG)
    out_b, _ = canonicalize(body(template.format(b)), CFG)
    assert rules == ["volatile_to_tail"]
    assert out_a["messages"][0] == out_b["messages"][0]
    assert out_a["messages"][0]["content"] == template.format("[volatile:1]")
    assert out_a["messages"][-1]["content"].endswith(f"[volatile:1] = {a}")


def test_the_moved_pattern_is_named() -> None:
    done = canonicalize_detail(body("At 2026-11-22 for session_id=ab12, ok."), CFG)
    assert [m.tag for m in done.moved] == ["pattern:2", "pattern:5"]
    assert done.unmatched == ("At [volatile:1] for [volatile:2], ok.",)


def test_spans_that_vary_with_a_stable_context_are_learned_and_moved() -> None:
    rng = random.Random(7)
    texts = [prompt(rng, tier=t, name=n, day="Tuesday") for t, n in zip(TIERS, NAMES, strict=True)]
    assert learn(texts[1], texts[:1], LEARN) is None  # two requests: not yet
    template = learn(texts[2], texts[1::-1], LEARN)
    assert template is not None
    assert template.labels == ("Customer tier:", "session=", "user_name:", "It's Tuesday", "Kontonummer")
    assert template.parts[-3].endswith("It's Tuesday ")  # one day only so far: constant, not a value
    outs = [canonicalize_detail(body(t), CFG, templates=(template,)) for t in texts]
    systems = {o.body["messages"][0]["content"] for o in outs}
    assert len(systems) == 1  # every request now shares its whole system prompt
    system = systems.pop()
    assert "GOLD" not in system and "alice" not in system and "Customer tier: [volatile:1]" in system
    note = outs[0].body["messages"][-1]["content"]
    assert note.startswith("Where is my parcel?\n\nContext values: [volatile:1] = GOLD; ")
    assert [m.tag for m in outs[0].moved][:2] == [f"learned:{template.id}[Customer tier:]"] + [
        f"learned:{template.id}[session=]"
    ]
    assert all(o.unmatched == () for o in outs)


def test_requests_differing_only_in_a_moved_value_never_share_a_key_or_scope() -> None:
    rng = random.Random(3)
    texts = [prompt(rng, tier=TIERS[i], name=NAMES[i], day="Friday", hour=3) for i in range(3)]
    template = learn(texts[2], texts[1::-1], LEARN)
    assert template is not None
    gold, silver = (
        canonicalize_detail(body(t), CFG, templates=(template,)).body for t in (texts[0], texts[1])
    )
    assert gold["messages"][0] == silver["messages"][0]  # one prefix for the backend
    k1, k2 = (request_keys("tenant", "m", "chat", b) for b in (gold, silver))
    assert k1.query == k2.query  # the question is the same text
    assert k1.exact != k2.exact and k1.scope != k2.scope  # the values keep them apart


def test_one_off_prompts_and_rare_variants_are_not_volatile() -> None:
    rng = random.Random(1)
    base = prompt(rng)
    other_sentence = base.replace("Refunds take five working days.", "Refunds take ten days, sometimes more.")
    unrelated = "You are a pirate. Speak like one. " * 20
    learner = VolatileLearner()
    # the same prompt again and again, one prompt with another sentence, one unrelated prompt
    assert not any(feed(learner, "t", [base, base, other_sentence, base, unrelated, base]))
    assert learner.templates("t") == ()
    # two values taking turns (an A/B test of one word) are two templates, not a volatile span
    learner = VolatileLearner()
    a, b = base.replace("polite", "formal"), base.replace("polite", "friendly")
    assert not any(feed(learner, "t", [a, b, a, b, a, b]))
    assert learner.templates("t") == ()
    # a third value makes it a span
    assert feed(learner, "t", [base]) == [True]
    assert set(learner.templates("t")[0].labels) == {"Be brief and"}  # "polite", three times


def test_a_one_off_word_next_to_a_volatile_value_stays_constant() -> None:
    """One request with another word beside the session id: the word is not made a span (it changed in
    one prompt only), the session id is."""
    make = lambda session, word: f"session={session}\n" + POLICY.replace("polite", word) * 2
    learner = VolatileLearner()
    learned = feed(learner, "t", [make("a1", "polite"), make("b2", "polite"), make("c3", "rude")])
    assert learned == [False, False, False]  # the third prompt alone differs in the word
    assert feed(learner, "t", [make("d4", "polite")]) == [True]
    (template,) = learner.templates("t")
    assert template.labels == ("session=",)
    assert template.match(make("e5", "polite")) and template.match(make("e5", "rude")) is None


def test_no_learning_across_tenants() -> None:
    texts = varied(5)
    learner = VolatileLearner()
    feed(learner, "tenant-a", texts[:2])
    feed(learner, "tenant-b", texts[2:])  # three values in all, but two tenants
    assert learner.templates("tenant-a") == () and learner.templates("tenant-b") == ()
    assert feed(learner, "tenant-a", [texts[3]]) == [True]
    assert learner.templates("tenant-a") and learner.templates("tenant-b") == ()
    assert set(learner.view()) == {"tenant-a"}


def test_memory_is_capped_per_tenant_and_in_tenants() -> None:
    cfg = replace(LEARN, samples=4, templates=2, tenants=3, max_prompt_chars=2000)
    learner = VolatileLearner()
    rng = random.Random(9)
    distinct = [f"Prompt number {i}: " + "different words here. " * (i + 3) for i in range(10)]
    feed(learner, "t", distinct, cfg)
    assert learner.sample_count("t") == 4  # the oldest went first
    long = POLICY * 20  # over max_prompt_chars: never kept nor learned from
    assert learner.known("t", [long], cfg) and not feed(learner, "t", [long, long + "x", long + "y"], cfg)[-1]
    for k in range(3):  # three templates learned: only the two most recent are kept
        head = f"App {k} says: " + POLICY
        feed(learner, "t", [head + f"Order id {v}. " + POLICY for v in ("A1", "B2", "C3")], cfg)
    assert len(learner.templates("t")) == 2
    for tenant in ("u", "v", "w"):
        feed(learner, tenant, [prompt(rng)], cfg)
    assert "t" not in learner.view() and learner.templates("t") == ()  # least recently seen tenant dropped


def test_learn_config_is_checked() -> None:
    with pytest.raises(ValueError, match="min_requests"):
        LearnConfig(min_requests=1)
    with pytest.raises(ValueError, match="min_shared"):
        LearnConfig(min_shared=0.2)
    with pytest.raises(ValueError, match="unknown keys"):
        CanonicalizeConfig.from_dict({"learn": {"sample": 3}})
    off = replace(CFG, learn=replace(LEARN, enabled=False))
    assert canonicalize_detail(body(prompt(random.Random(0))), off).unmatched == ()


def test_learning_never_fails_on_mixed_traffic() -> None:
    """Prompts of three templates whose fields vary over a few values, some rarely, between one-offs:
    learning never raises, every template it learns fits the prompt it was learned from, and the
    tenant's templates stay within the cap."""
    rng = random.Random(11)
    heads = ["App one. ", "Second app here. ", "Third: "]
    learner = VolatileLearner()
    cfg = replace(LEARN, samples=12)
    for n in range(200):
        if n % 37 == 0:
            text = f"One-off prompt {n}. " + POLICY
        else:
            fixed = {k: rng.choice(v) for k, v in (("tier", TIERS[:2]), ("name", NAMES), ("day", DAYS))}
            text = rng.choice(heads) + prompt(rng, **fixed, hour=rng.choice([1, 1, 1, 2]))
        if learner.observe("t", [text], cfg):
            assert learner.templates("t")[0].match(text) is not None
    assert 1 <= len(learner.templates("t")) <= cfg.templates


def test_a_value_whose_parts_recur_in_another_is_one_span() -> None:
    """Two addresses sharing a number in other places ("150"): one span, not text added or dropped."""
    a, b = (f"Connected from {ip} today.\n" + POLICY for ip in ("129.146.150.190", "139.50.90.150"))
    spans = differences(a, b, LEARN)
    assert spans is not None and [a[i:j] for i, j in spans] == ["129.146.150.190"]
