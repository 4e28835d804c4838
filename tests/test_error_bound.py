"""The false-hit bound and the line it picks (policies/error_bound.py): pure, no model, no server."""

from __future__ import annotations

import math
import random

import pytest

from cachegw.policies.error_bound import (
    GRID,
    Evidence,
    bucket,
    choose_line,
    interval,
    min_audits,
    upper_bound,
)


def test_upper_bound_matches_the_closed_form_with_no_wrong_hit() -> None:
    # with 0 wrong in n, P(0 wrong) = (1-p)^n = 0.05 gives p = 1 - 0.05^(1/n)
    for n in (1, 10, 150, 1000):
        assert upper_bound(0, n) == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-9)
    assert upper_bound(0, 0) == 1.0 and upper_bound(5, 5) == 1.0


def test_upper_bound_is_the_binomial_tail_inverse() -> None:
    """P(Binomial(n, ub) <= k) = 0.05, checked by summing the binomial terms directly."""
    for k, n in ((1, 50), (3, 200), (10, 400)):
        ub = upper_bound(k, n)
        tail = sum(math.comb(n, i) * ub**i * (1 - ub) ** (n - i) for i in range(k + 1))
        assert tail == pytest.approx(0.05, abs=1e-9)
        assert k / n < ub


def test_interval_contains_the_estimate_and_is_exact_at_the_edges() -> None:
    lo, hi = interval(4, 100)
    assert lo < 0.04 < hi
    assert interval(0, 20)[0] == 0.0 and interval(20, 20)[1] == 1.0
    with pytest.raises(ValueError):
        interval(3, 2)


def test_min_audits() -> None:
    assert min_audits(0.02) == 149 and min_audits(0.05) == 59
    assert upper_bound(0, min_audits(0.02)) <= 0.02 < upper_bound(0, min_audits(0.02) - 1)


def test_buckets_follow_the_grid() -> None:
    assert bucket(0.49) == -1 and bucket(0.5) == 0 and bucket(0.885) == 38 and bucket(1.0) == len(GRID) - 1
    assert bucket(0.93) == GRID.index(0.93)  # 0.93 is not 0.9299999 here


def _evidence(pairs: list[tuple[float, bool, int]]) -> Evidence:
    ev = Evidence()
    for score, right, n in pairs:
        ev.add(score, right, n)
    return ev


def test_too_little_evidence_serves_nothing() -> None:
    assert choose_line(Evidence(), 0.05).line is None
    ev = _evidence([(0.95, True, 100)])  # 100 right audits: 149 are needed for 2%
    assert choose_line(ev, 0.02).line is None
    assert choose_line(ev, 0.05).line == 0.95  # 59 suffice for 5%


def test_the_line_rises_after_wrong_hits_and_relaxes_as_right_ones_accumulate() -> None:
    ev = _evidence([(0.97, True, 200), (0.90, True, 200)])
    assert choose_line(ev, 0.02).line == 0.90
    ev.add(0.91, False, 6)  # wrong hits in the 0.90-0.92 band
    raised = choose_line(ev, 0.02)
    assert raised.line is not None and raised.line > 0.91
    ev.add(0.91, True, 800)  # right ones accumulate in the same band
    assert choose_line(ev, 0.02).line == 0.90


def test_the_sequence_stops_at_the_first_failure() -> None:
    """A bad band between two good ones: lines under it are never reached, however good below."""
    ev = _evidence([(0.98, True, 300), (0.85, True, 300), (0.80, False, 20), (0.60, True, 100_000)])
    choice = choose_line(ev, 0.02)
    assert choice.line == 0.85  # the lowest audited line above the bad band
    assert choice.bound <= 0.02


def test_family_wise_error_holds_on_simulated_audits() -> None:
    """Pairs whose wrong rate rises as the score falls: the chosen line's true false-hit rate exceeds
    the target in at most ~5% of runs (fixed-sequence testing needs no correction for the scan)."""
    rng = random.Random(7)
    target, runs, over = 0.05, 200, 0

    def p_wrong(score: float) -> float:  # 0 at 1.0, 0.5 at 0.5
        return max(0.0, 1.0 - score)

    def true_rate(line: float) -> float:
        cells = [g for g in GRID if g >= line]
        return sum(p_wrong(g + 0.005) for g in cells) / len(cells)

    for _ in range(runs):
        ev = Evidence()
        for _ in range(1500):
            s = rng.uniform(0.5, 1.0)
            ev.add(s, rng.random() >= p_wrong(s))
        c = choose_line(ev, target)
        if c.line is not None and true_rate(c.line) > target:
            over += 1
    assert over / runs <= 0.08


def test_the_audit_budget_is_a_token_bucket_that_never_waits() -> None:
    from cachegw.gateway.cache.audits import TokenBucket

    now = [0.0]
    bucket = TokenBucket(2.0, clock=lambda: now[0])  # 2 a second, a burst of 2
    assert [bucket.take() for _ in range(3)] == [True, True, False]
    now[0] += 0.5  # one token back
    assert [bucket.take() for _ in range(2)] == [True, False]
    slow = TokenBucket(0.001, clock=lambda: now[0])
    assert [slow.take() for _ in range(3)] == [True, False, False]
    assert not TokenBucket(0.0, clock=lambda: now[0]).take()  # 0: no audits at all


def test_analyze_reads_and_prints_the_evidence(tmp_path, capsys) -> None:
    """`cachegw analyze`'s section: per scope the line, the estimate at it and its interval, from a real
    SQLite evidence table; the history the dashboard draws is cumulative over served hits only."""
    from cachegw.gateway.cache.error_control import history
    from cachegw.gateway.config import load_settings
    from cachegw.gateway.offline.false_hit_report import print_false_hits, read_false_hits
    from cachegw.gateway.storage.evidence_store import EvidenceRow, EvidenceStore
    from cachegw.gateway.storage.store import Store

    url = f"sqlite:///{tmp_path / 'cachegw.db'}"
    rows = [EvidenceRow("m", "t", 0.95, i % 50 != 0, "hit", 100.0 + i, backend_tokens=10) for i in range(200)]
    store = Store(url)
    try:
        EvidenceStore(store.session).add([*rows, EvidenceRow("m", "t", 0.7, False, "near-miss", 500.0)])
    finally:
        store.close()
    s = load_settings(None)
    s = s.model_copy(update={"cache": s.cache.updated({"max_false_hit_rate": 0.05})})
    view = read_false_hits(url, s)
    scope = view["by_scope"]["m|t"]
    assert (scope["line"], scope["wrong"], scope["audits"], scope["evidence"]) == (0.95, 4, 200, 201)
    assert scope["interval"][0] < scope["estimate"] == 0.02 < scope["interval"][1]  # two-sided: wider
    assert view["audit_backend_tokens"] == 2000
    print_false_hits(view)
    out = capsys.readouterr().out
    assert "m|t: 2.00% [" in out and "line 0.95" in out and "2,000 backend tokens" in out
    points = history(rows, 100.0, 300.0, 100.0, 0.95)
    assert [p["audits"] for p in points] == [100, 200] and points[-1]["estimate"] == 0.02


def test_the_audit_re_ask_carries_a_low_priority_where_the_backend_honours_it() -> None:
    """``audit_send_priority`` "auto": only to the built-in engine (a vLLM without priority scheduling
    refuses a non-zero priority); "always" and "never" say it for every backend."""
    from cachegw.gateway.cache.audits import AuditJob, Auditor
    from cachegw.gateway.config import load_settings
    from cachegw.gateway.storage.tables import CacheEntry

    base = load_settings(None).cache
    job = AuditJob("hit", "m", "t", 0.9, CacheEntry(), "r1", "chat", {"messages": [], "stream": True})

    def body(builtin: bool, mode: str) -> dict:
        c = base.updated({"audit_send_priority": mode})
        return Auditor(None, None, None, lambda: c, builtin_backend=builtin).reask_body(job)  # type: ignore[arg-type]

    assert (
        body(True, "auto") == {"messages": [], "priority": base.audits.priority} and base.audits.priority > 0
    )
    assert "priority" not in body(False, "auto") and "priority" not in body(True, "never")
    assert body(False, "always")["priority"] == base.audits.priority
