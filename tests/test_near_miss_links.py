"""Near misses that become hits (gateway/cache/links.py): the link bookkeeping itself, then the real
gateway on loopback over real SQLite with the real encoder and verifier, then replicas on a real
PostgreSQL reading each other's links through the change log.

The backend is the small test server of testkit/servers.py (``recording_upstream``): its answer is
whatever the test sets, so whether a near miss's fresh answer equals the stored one is known in advance
(the built-in engine cannot be told which answers are right). The verifier's threshold is put at 1.0 so
it refuses every paraphrase: each one is a near miss refused by the verifier alone, whatever the model's
probability for that pair.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cachegw.gateway.cache.links import EntryLinks
from cachegw.gateway.storage.evidence_store import EvidenceRow
from tests.test_error_bound_gateway import api, bound_settings, eventually, upstream  # noqa: F401
from tests.test_gateway import MovableClock, ask, chat, gateway
from tests.test_replica_sync import NEVER_S, encoder, pg_url, replicas  # noqa: F401 (fixtures)

A = "What is the capital of France?"
B = "what's the capital of france"  # cosine 0.908 to A
C = "Which city is the capital of France?"  # 0.942 to A, 0.923 to B
D = "What city is France's capital?"  # 0.956 to A, 0.910 to B


def near_miss(entry: int, own: int, right: bool = True) -> EvidenceRow:
    return EvidenceRow("m", "t", 0.4, right, "near-miss", 0.0, entry, "r", 0, None, own)


def test_right_near_misses_link_and_any_wrong_verdict_unlinks() -> None:
    links = EntryLinks(limit=2)
    links.apply([near_miss(1, 2), near_miss(3, 4), near_miss(5, 5)])  # an entry never links to itself
    assert links.linked(1, 2) and links.linked(2, 1) and links.linked(3, 4) and len(links) == 2
    links.apply([near_miss(6, 7, right=False)])  # a wrong near miss links nothing
    assert not links.linked(6, 7)
    links.apply([EvidenceRow("m", "t", 0.9, False, "feedback", 0.0, 2)])  # a bad-hit report on 2
    assert not links.linked(1, 2) and links.linked(3, 4)
    links.apply([near_miss(1, 8), near_miss(9, 10)])  # over the limit: the oldest link goes
    assert not links.linked(3, 4) and links.linked(1, 8) and links.linked(9, 10)


def settings(tmp_path: Path, backend: str, links: bool):  # type: ignore[no-untyped-def]
    return bound_settings(
        tmp_path,
        backend,
        verifier=True,
        verifier_threshold=1.0,
        max_false_hit_rate=0.0,  # static thresholds: links serve only there
        near_miss_links=links,
    )


def audited(url: str, n: int) -> None:
    """Wait until the replica's auditor has judged ``n`` audits."""

    def done() -> bool:
        verdicts = api(url, "GET", "/stats").json()["false_hit_rate"]["audits_by_verdict"]
        return verdicts.get("right", 0) + verdicts.get("wrong", 0) >= n

    eventually(done)


@pytest.mark.parametrize("links", [True, False])
def test_a_request_near_both_ends_of_a_link_is_served(upstream, tmp_path, links) -> None:  # noqa: F811
    up, backend = upstream
    with gateway(settings(tmp_path, backend, links), MovableClock()) as url:
        assert chat(url, ask(A), max_tokens=8)[1]["x-cache"] == "miss"  # stored: "Paris"
        h = chat(url, ask(B), max_tokens=8)[1]  # A refused by the verifier: a near miss, stored too
        assert (h["x-cache"], h["x-cache-reason"]) == ("miss", "verifier")
        if not links:  # without links nothing is audited and C misses as B did
            h = chat(url, ask(C), max_tokens=8)[1]
            assert (h["x-cache"], h["x-cache-reason"]) == ("miss", "verifier")
            return
        audited(url, 1)  # B's fresh "Paris" equals A's: A and B linked
        up.answer = "Lyon"  # from now on the backend says otherwise
        text, h, _ = chat(url, ask(C), max_tokens=8)
        assert (h["x-cache"], h["x-cache-reason"], text) == ("semantic-hit", "link", "Paris")
        # another tenant's request is never served by this tenant's link
        other = chat(url, ask(C), max_tokens=8, key="tenant-b")[1]
        assert other["x-cache"] == "miss"
        # the link hit is audited like any hit: re-asked, "Lyon" is not "Paris", so A's links go
        audited(url, 2)
        h = chat(url, ask(D), max_tokens=8)[1]
        assert (h["x-cache"], h["x-cache-reason"]) == ("miss", "verifier")


async def test_links_reach_every_replica_through_the_change_log(pg_url, encoder) -> None:  # noqa: F811
    """A link recorded on one replica links the two entries on the others once they read its row; a
    wrong verdict recorded on another replica unlinks them everywhere."""
    async with replicas(pg_url, 2, encoder, NEVER_S) as (a, b):
        await a.lines.record([near_miss(11, 12)])
        newest = a.newest()
        for r in (a, b):
            await r.caught_up(newest)
            assert r.lines.links.linked(11, 12)
        await b.lines.record([EvidenceRow("m", "t", 0.9, False, "hit", 0.0, 12)])
        newest = b.newest()
        for r in (a, b):
            await r.caught_up(newest)
            assert not r.lines.links.linked(11, 12)
