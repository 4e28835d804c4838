"""The prior's calibration families weighed by a scope's own audits (policies/prior_families.py): the
shipped prior's real counts against deterministic audit streams, the threshold provider over real
SQLite, then the real gateway on loopback in front of the test upstream of testkit/servers.py (its
answer is set by the test, so each audit's verdict is known in advance; the verifier is off, so the
line is on the cosine and a repeat of the stored question scores 1.0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachegw.gateway.cache.error_control import ScopeLine, ThresholdProvider
from cachegw.gateway.cache.prior_loader import load_priors
from cachegw.gateway.config import load_settings
from cachegw.gateway.storage.evidence_store import EvidenceRow, EvidenceStore
from cachegw.gateway.storage.store import Store
from cachegw.policies.bound_prior import PriorCounts, contradicts
from cachegw.policies.error_bound import GRID, Evidence
from cachegw.policies.prior_families import resembled, weights
from tests.test_error_bound_gateway import Q0, ask_and_audit, bound_settings, scope_view, upstream  # noqa: F401
from tests.test_gateway import MovableClock, ask, chat, gateway

SCORES = (0.80, 0.85, 0.90, 0.95, 0.99)  # audits spread over the upper bands, as near misses and hits are


def audits(n: int, wrong_every: int = 0) -> list[tuple[float, bool]]:
    """``n`` audits cycling through ``SCORES``; every ``wrong_every``-th is wrong (0: none)."""
    return [(SCORES[i % len(SCORES)], not (wrong_every and (i + 1) % wrong_every == 0)) for i in range(n)]


def evidence(stream: list[tuple[float, bool]]) -> Evidence:
    ev = Evidence()
    for score, right in stream:
        ev.add(score, right)
    return ev


def shipped() -> dict[str, PriorCounts]:
    return load_priors("shipped")["verifier"]


def test_before_any_audit_the_families_weigh_the_same_and_their_mixture_is_cautious() -> None:
    mix = resembled(Evidence(), shipped())
    assert mix is not None and mix.weights == {"qqp": 0.5, "banking77": 0.5}
    # each family counts by its weight, not its size: the mixture holds the larger family's total
    assert mix.counts.total == pytest.approx(max(p.total for p in shipped().values()))
    assert resembled(Evidence(), {}) is None


def test_intent_like_audits_pick_the_intent_family_and_question_like_ones_the_qqp_family() -> None:
    """The stated numbers (docs/verifier.md): 25 right audits give banking77 over 0.99; 10 audits with
    3 wrong give QQP over 0.99."""
    assert weights(evidence(audits(20)), shipped())["banking77"] > 0.98
    assert weights(evidence(audits(25)), shipped())["banking77"] > 0.99
    assert weights(evidence(audits(10, wrong_every=3)), shipped())["qqp"] > 0.99
    # a stream at 1 wrong in 50 stays with the intents
    assert weights(evidence(audits(100, wrong_every=50)), shipped())["banking77"] > 0.99


def provider(tmp_path: Path) -> ThresholdProvider:
    store = Store(f"sqlite:///{tmp_path / 'cachegw.db'}")
    return ThresholdProvider(EvidenceStore(store.session), lambda: 0.0, None, load_priors("shipped"))


def rows(scope: str, stream: list[tuple[float, bool]]) -> list[EvidenceRow]:
    return [EvidenceRow("m", scope, s, r, "near-miss", 0.0) for s, r in stream]


def line(lines: ThresholdProvider, tenant: str) -> ScopeLine:
    c = load_settings(None).cache.updated({"max_false_hit_rate": 0.05, "false_hit_prior": "shipped"})
    found = lines.line("m", tenant, c)
    assert found is not None
    return found


def test_each_scope_is_pulled_to_its_own_traffic_within_the_stated_audits(tmp_path) -> None:
    lines = provider(tmp_path)
    assert line(lines, "desk").line is None  # no audit yet: the mixture allows no line
    lines.apply(rows("desk", audits(20)) + rows("forum", audits(10, wrong_every=3)))
    desk, forum = line(lines, "desk"), line(lines, "forum")
    assert desk.line is not None and desk.line <= 0.9 and desk.prior > 1000  # served from 20 audits on
    assert desk.families["banking77"] > 0.98
    assert forum.line is None  # QQP-like: no line, as its own evidence says
    # a desk that turns bad: three wrong in its next ten, and its own audits overrule the prior
    lines.apply(rows("desk", audits(10, wrong_every=3)))
    assert line(lines, "desk").line is None


def prior_file(path: Path) -> str:
    """Two families on the cosine, 40 pairs each at 1.0: "clean" all right, "noisy" half wrong. Their
    even mixture (10 wrong in 40) allows no line at target 0.3 and confidence 0.8; "clean" does."""
    clean, noisy = [0.0] * len(GRID), [0.0] * len(GRID)
    audits40 = [0.0] * len(GRID)
    audits40[-1], noisy[-1] = 40.0, 20.0
    fam = {
        "clean": {"cosine": {"audits": audits40, "wrong": clean}},
        "noisy": {"cosine": {"audits": audits40, "wrong": noisy}},
    }
    doc = {"grid": list(GRID), "kinds": {"cosine": {"audits": audits40, "wrong": noisy}}, "families": fam}
    path.write_text(json.dumps(doc))
    return str(path)


def test_the_gateway_weighs_the_families_by_its_audits(upstream, tmp_path) -> None:  # noqa: F811
    _, backend = upstream
    prior = prior_file(tmp_path / "prior.json")
    clock = MovableClock()
    s = bound_settings(tmp_path, backend, false_hit_prior=prior, false_hit_prior_strength=40.0)
    with gateway(s, clock) as url:
        assert chat(url, ask(Q0), max_tokens=8)[1]["x-cache"] == "miss"  # stored: "Paris"
        h = ask_and_audit(url, Q0, clock)  # the even mixture: no line; a near miss, audited right
        assert (h["x-cache"], h["x-cache-reason"]) == ("miss", "error-bound")
        assert scope_view(url)["prior_families"]["clean"] > 0.6  # one right audit: 0.66 on "clean"
        # served after that one audit; without the prior, 5 right audits are needed (min_audits)
        assert ask_and_audit(url, Q0, clock)["x-cache"] == "semantic-hit"
        view = scope_view(url)
        assert view["line"] == 1.0 and view["prior_families"]["clean"] > 0.75 and view["prior_audits"] > 0


def test_live_audits_over_the_target_overrule_a_prior_they_do_not_reject() -> None:
    """8% wrong in 25 audits at the line: a 3% prior would see that one time in six (no rejection), but
    the scope's own audits say the target is missed, so the prior goes (``CHECK_AFTER`` = 20)."""
    prior = PriorCounts(
        tuple(1000.0 if g == 0.95 else 0.0 for g in GRID), tuple(30.0 if g == 0.95 else 0.0 for g in GRID)
    )
    live = evidence([(0.95, True)] * 23 + [(0.95, False)] * 2)
    assert contradicts(live, prior, 0.95, target=0.05)
    assert not contradicts(live, prior, 0.95, target=0.10)  # within that target, and no rejection
    few = evidence([(0.95, True)] * 17 + [(0.95, False)])  # 1 in 18: too few to overrule by share
    assert not contradicts(few, prior, 0.95, target=0.05)
