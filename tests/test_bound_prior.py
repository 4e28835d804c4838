"""The false-hit bound's prior (policies/bound_prior.py, gateway/cache/prior_loader.py) and a request's
own risk budget (``x-cache-max-false-hit-rate``): the threshold provider over a real SQLite evidence
table with synthetic audits, then the real gateway on loopback in front of the test upstream, verifier
off (the line is on the cosine; a repeat of a stored question scores 1.0)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from cachegw.gateway.cache.error_control import ThresholdProvider
from cachegw.gateway.cache.prior_loader import SHIPPED, load_priors
from cachegw.gateway.config import CacheConfig, load_settings
from cachegw.gateway.offline.bound_prior import first_candidates, sha256
from cachegw.gateway.storage.evidence_store import EvidenceRow, EvidenceStore
from cachegw.gateway.storage.store import Store
from cachegw.policies.bound_prior import PriorCounts, PriorWeight, with_prior
from cachegw.policies.error_bound import GRID, Evidence, choose_line, upper_bound
from cachegw.policies.verifier import ARTIFACT_PATH
from tests.test_calibrate import PAIRS, _run_json, pairs_csv  # noqa: F401 (a fixture)
from tests.test_error_bound_gateway import Q0, bound_settings, upstream  # noqa: F401 (a fixture)
from tests.test_gateway import MovableClock, ask, chat, gateway

TARGET = 0.05
FADE = 200


def counts(cells: dict[float, tuple[int, int]]) -> PriorCounts:
    """A prior from {line: (audits, wrong)}."""
    audits, wrong = [0.0] * len(GRID), [0.0] * len(GRID)
    for line, (n, w) in cells.items():
        audits[GRID.index(line)], wrong[GRID.index(line)] = float(n), float(w)
    return PriorCounts(tuple(audits), tuple(wrong))


# calibration pairs: right 99% of the time at 0.95 and above, 80% at 0.80
PRIOR = counts({0.95: (400, 4), 0.80: (400, 100)})


def config(prior: str = "shipped", strength: float = 1000.0) -> CacheConfig:
    over = {"max_false_hit_rate": TARGET, "false_hit_prior": prior, "false_hit_prior_strength": strength}
    return load_settings(None).cache.updated({**over, "false_hit_prior_fade": FADE})


def provider(tmp_path: Path) -> ThresholdProvider:
    store = Store(f"sqlite:///{tmp_path / 'cachegw.db'}")
    return ThresholdProvider(EvidenceStore(store.session), lambda: 0.0, None, {"verifier": {"all": PRIOR}})


def rows(n: int, score: float, right: bool) -> list[EvidenceRow]:
    return [EvidenceRow("m", "t", score, right, "hit", 0.0) for _ in range(n)]


def test_the_shipped_prior_loads_with_its_provenance() -> None:
    priors = load_priors("shipped")
    assert set(priors) == {"verifier", "cosine"}
    # the families kept apart, each with its own candidates
    assert all(set(f) == {"qqp", "banking77"} for f in priors.values())
    assert all(p.total > 100 for f in priors.values() for p in f.values())
    prov = json.loads(SHIPPED.read_text())["provenance"]
    assert prov["verifier_sha256"] == sha256(ARTIFACT_PATH)  # counted with the verifier that ships
    assert {"date", "command", "encoder", "cross_encoder_sha256", "pairs"} <= set(prov)
    assert {"qqp_dev.csv", "banking77_train.csv"} <= set(prov["data"])
    assert all("rule" in d and d["pairs"] > 0 for d in prov["data"].values())
    # counted from the candidates a cache meets, not from curated pairs
    assert all("nearest" in d["pairing"] for d in prov["data"].values())
    assert load_priors("none") == {}
    with pytest.raises(ValueError, match="cannot read"):
        load_priors("/nonexistent/prior.json")


def test_fractional_counts_sit_between_their_integer_neighbours() -> None:
    assert upper_bound(2, 100) < upper_bound(2.5, 100) < upper_bound(3, 100)
    assert upper_bound(2, 100.5) < upper_bound(2, 100)
    assert upper_bound(0, 59.5) <= 0.05 < upper_bound(0, 58.0)
    assert upper_bound(3.0000000000001, 3.0) == 1.0  # a float sum just past n is clipped


def test_the_weight_is_bounded_and_fades_linearly() -> None:
    w = PriorWeight(strength=400.0, fade=FADE)
    assert w.scale(PRIOR.total, 0) == pytest.approx(0.5)  # 800 pairs count as 400 audits
    assert w.scale(PRIOR.total, FADE / 2) == pytest.approx(0.25)
    assert w.scale(PRIOR.total, FADE) == 0.0 and PriorWeight(0.0, FADE).scale(PRIOR.total, 0) == 0.0
    merged, pseudo = with_prior(Evidence(), PRIOR, w)
    assert pseudo == pytest.approx(400.0) and merged.at(0.95) == pytest.approx((2.0, 200.0))


def test_with_no_live_evidence_a_scope_gets_its_line_from_the_prior(tmp_path) -> None:
    lines = provider(tmp_path)
    sl = lines.line("m", "t", config())
    assert sl is not None and sl.line == 0.95 and sl.prior == pytest.approx(800.0)
    assert sl.serves(0.96) and not sl.serves(0.90)
    assert lines.line("m", "t", config(prior="none")).line is None  # today's behaviour: no evidence


def test_live_wrong_audits_pull_the_line_off_and_fade_hands_over_to_live_evidence(tmp_path) -> None:
    """A scope whose traffic is worse than the calibration pairs (20% wrong at 0.95, where the prior
    says 1%) loses its line within a few audits and has its live-only line after ``fade``."""
    lines = provider(tmp_path)
    c = config()
    lines.apply(rows(9, 0.95, True) + rows(1, 0.95, False))
    sl = lines.line("m", "t", c)
    assert sl.line == 0.95 and sl.prior > 0  # one wrong in 10: not yet against a 1% prior
    lines.apply(rows(1, 0.95, False))
    sl = lines.line("m", "t", c)  # two wrong in 11 would come under 1 time in 100 at 1%: prior dropped
    assert sl.line is None and sl.prior == 0.0
    assert sl.choice == choose_line(lines.evidence[("m", "t")], TARGET)
    lines.apply(rows(152, 0.95, True) + rows(37, 0.95, False))  # 200 live audits: the prior is gone
    sl = lines.line("m", "t", c)
    live = lines.evidence[("m", "t")]
    assert sl.prior == 0.0 and sl.choice == choose_line(live, TARGET)
    # clean live evidence after fade: the line is the live one, whatever the prior said
    lines.apply(rows(400, 0.99, True))
    assert lines.line("m", "t", c).choice == choose_line(lines.evidence[("m", "t")], TARGET)


def test_a_request_may_tighten_its_target_but_never_loosen_it(tmp_path) -> None:
    lines = provider(tmp_path)
    c = config()
    assert lines.line("m", "t", c, cap=0.5).target == TARGET  # looser: the configured one holds
    tight = lines.line("m", "t", c, cap=0.001)
    assert tight.target == 0.001 and tight.line is None  # 800 pairs cannot vouch for 0.1%
    off = c.updated({"max_false_hit_rate": 0.0})
    assert lines.line("m", "t", off) is None  # no target configured: static thresholds...
    assert lines.line("m", "t", off, cap=0.05).line == 0.95  # ...unless the request sets one


def test_only_each_querys_first_accepted_candidate_counts() -> None:
    """Pairs come nearest first per query; the tier serves the first its verifier accepts."""
    nan = float("nan")
    scores = np.array([nan, 0.9, 0.95, 0.7, nan, nan])
    query = np.array([0, 0, 0, 1, 2, 2])
    out = first_candidates(scores, query)
    assert np.isnan(out[[0, 2, 4, 5]]).all() and out[1] == 0.9 and out[3] == 0.7


def prior_file(path: Path) -> str:
    """A prior on the cosine: 20 clean pairs at 1.0, enough for target 0.3 at confidence 0.8 (the
    sequence starts at 3 x 5 with a prior)."""
    one = counts({1.0: (20, 0)})
    doc = {"grid": list(GRID), "kinds": {"cosine": {"audits": one.audits, "wrong": one.wrong}}}
    path.write_text(json.dumps(doc))
    return str(path)


def test_the_gateway_serves_from_the_prior_and_honours_the_request_budget(upstream, tmp_path) -> None:  # noqa: F811
    _, backend = upstream
    prior = prior_file(tmp_path / "prior.json")
    s = bound_settings(tmp_path, backend, false_hit_prior=prior, false_hit_prior_strength=20.0)
    with gateway(s, MovableClock()) as url:
        assert chat(url, ask(Q0), max_tokens=8)[1]["x-cache"] == "miss"  # stored
        h = chat(url, ask(Q0), max_tokens=8)[1]
        assert (h["x-cache"], h["x-cache-bound"]) == ("semantic-hit", "0.3")  # no audit yet: the prior
        h = chat(url, ask(Q0), max_tokens=8, extra_headers={"x-cache-max-false-hit-rate": "0.5"})[1]
        assert (h["x-cache"], h["x-cache-bound"]) == ("semantic-hit", "0.3")  # never loosened
        h = chat(url, ask(Q0), max_tokens=8, extra_headers={"x-cache-max-false-hit-rate": "0.01"})[1]
        assert (h["x-cache"], h["x-cache-reason"]) == ("miss", "error-bound")  # 20 pairs vouch for 0.3 only
        assert "x-cache-bound" not in h
        for bad in ("abc", "0", "1", "-0.1", "nan", ""):
            r = httpx.post(
                f"{url}/v1/chat/completions",
                json={"messages": ask(Q0), "max_tokens": 8},
                headers={"authorization": "Bearer tenant-a", "x-cache-max-false-hit-rate": bad},
                timeout=30,
            )
            assert r.status_code == 400, bad
            err = r.json()["error"]
            assert err["param"] == "x-cache-max-false-hit-rate" and set(err) >= {"message", "type", "code"}


def test_without_the_prior_the_gateway_serves_nothing_from_no_evidence(upstream, tmp_path) -> None:  # noqa: F811
    _, backend = upstream
    with gateway(bound_settings(tmp_path, backend), MovableClock()) as url:  # false_hit_prior "none"
        chat(url, ask(Q0), max_tokens=8)
        h = chat(url, ask(Q0), max_tokens=8)[1]
        assert (h["x-cache"], h["x-cache-reason"]) == ("miss", "error-bound")


def test_a_later_start_lets_large_evidence_survive_one_wrong_hit_at_the_top() -> None:
    ev = Evidence()
    ev.add(0.99, True, 59)
    ev.add(0.99, False)
    ev.add(0.95, True, 396)
    ev.add(0.95, False, 4)
    assert choose_line(ev, TARGET).line is None  # tested first on 60 pairs, 1 wrong: over 5%
    assert choose_line(ev, TARGET, start=3 * 59).line == 0.95  # first tested on 460 pairs


def test_calibrate_writes_a_prior_the_gateway_loads(capsys, pairs_csv, tmp_path) -> None:  # noqa: F811
    out = tmp_path / "prior.json"
    res = _run_json(capsys, ["--pairs", str(pairs_csv), "--write-prior", str(out)])
    priors = load_priors(str(out))
    assert set(priors) == {"verifier", "cosine"}
    assert all(set(f) == {"all"} for f in priors.values())  # one family: the operator's pairs
    assert res["prior"] == max(f["all"].total for f in priors.values()) > 0
    prov = json.loads(out.read_text())["provenance"]
    assert prov["data"][pairs_csv.name]["pairs"] == len(PAIRS) == prov["pairs"]
    assert prov["verifier_sha256"] == sha256(ARTIFACT_PATH)
