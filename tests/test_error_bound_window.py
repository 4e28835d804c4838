"""Per-entry lines and evidence ageing (gateway/cache/error_control.py, policies/evidence_window.py): the
threshold provider over a real SQLite evidence table, an injectable clock, no model, no server."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cachegw.gateway.cache.error_control import ThresholdProvider, evidence_of
from cachegw.gateway.config import CacheConfig, load_settings
from cachegw.gateway.storage.evidence_store import EvidenceRow, EvidenceStore
from cachegw.gateway.storage.store import Store
from cachegw.policies.error_bound import min_audits
from cachegw.policies.evidence_window import Ageing

TARGET = 0.05  # 59 clean audits are the least that pass at 95%


def config() -> CacheConfig:
    return load_settings(None).cache.updated({"max_false_hit_rate": TARGET})


def rows(n: int, score: float, right: bool, ts: float = 0.0, entry: int | None = None) -> list[EvidenceRow]:
    return [EvidenceRow("m", "t", score, right, "hit", ts, entry) for _ in range(n)]


def provider(tmp_path: Path, now: list[float], ageing: Ageing | None = None) -> ThresholdProvider:
    store = Store(f"sqlite:///{tmp_path / 'cachegw.db'}")
    return ThresholdProvider(EvidenceStore(store.session), lambda: now[0], ageing)


def test_an_entry_with_enough_evidence_of_its_own_gets_its_own_line(tmp_path) -> None:
    assert min_audits(TARGET) == 59
    lines = provider(tmp_path, [0.0])
    lines.apply(rows(300, 0.95, True))  # seeds: the scope serves from 0.95
    lines.apply(rows(50, 0.93, True, entry=1) + rows(20, 0.93, False, entry=1))  # entry 1: often wrong
    lines.apply(rows(58, 0.90, True, entry=2))  # entry 2: good below the scope's line, one audit short
    c = config()
    sl = lines.line("m", "t", c)
    assert sl is not None and sl.line == 0.95  # entry 1's wrong hits keep the scope's line above 0.93
    assert sl.serves(0.97, entry_id=3)  # no evidence of its own: the scope's line
    assert not sl.serves(0.97, entry_id=1)  # its own evidence fails the bound: no semantic hit
    assert not sl.serves(0.90, entry_id=2)  # 58 < 59: the scope decides
    lines.apply(rows(1, 0.90, True, entry=2))
    sl = lines.line("m", "t", c)
    assert sl is not None and sl.serves(0.90, entry_id=2) and not sl.serves(0.90, entry_id=3)
    assert lines.view(c)["by_scope"]["m|t"]["entries_with_own_line"] == 2  # entries 1 and 2


def test_a_bad_hit_report_counts_against_the_entry_too(tmp_path) -> None:
    """Reports find the hit's entry through the auditor's memory of recent hits."""
    from cachegw.gateway.cache.audits import AuditJob, Auditor
    from cachegw.gateway.storage.tables import CacheEntry

    lines = provider(tmp_path, [0.0])
    c = config().updated({"audit_fraction": 0.0})
    auditor = Auditor(lines, None, None, lambda: c)  # type: ignore[arg-type]
    auditor.offer(AuditJob("hit", "m", "t", 0.97, CacheEntry(id=5), "req-1", "chat", {}))
    assert asyncio.run(auditor.bad_report("req-1"))
    assert lines.entries[5].evidence.wrong == lines.evidence[("m", "t")].wrong
    assert lines.evidence[("m", "t")].at(0.97) == (1, 1)


def test_the_newest_audits_window_forgets_old_wrong_hits(tmp_path) -> None:
    lines = provider(tmp_path, [0.0], Ageing(max_audits=100))
    lines.apply(rows(20, 0.95, False, ts=1.0))  # an old bad spell
    lines.apply(rows(80, 0.95, True, ts=2.0))
    sl = lines.line("m", "t", config())
    assert sl is not None and sl.line is None  # 20 wrong in 100: no line
    lines.apply(rows(20, 0.95, True, ts=3.0))  # pushes the 20 wrong ones out
    sl = lines.line("m", "t", config())
    assert sl is not None and sl.line == 0.95 and lines.evidence[("m", "t")].total == 100


def test_evidence_older_than_max_age_expires_on_the_clock(tmp_path) -> None:
    now = [1000.0]
    lines = provider(tmp_path, now, Ageing(max_age_s=100.0))
    asyncio.run(lines.record(rows(100, 0.95, True, ts=950.0)))  # in the database too
    asyncio.run(lines.record(rows(5, 0.95, False, ts=990.0)))
    sl = lines.line("m", "t", config())
    assert sl is not None and sl.line is None  # 5 wrong in 105: bound over 5%
    now[0] = 1060.0  # the 100 right ones are now 110 s old: only the wrong ones remain
    assert lines.evidence[("m", "t")].total == 105
    sl = lines.line("m", "t", config())
    assert sl is not None and sl.line is None and lines.evidence[("m", "t")].total == 5
    # a restart reads back only the window; analyze's view is the same
    fresh = ThresholdProvider(lines.store, lambda: now[0], Ageing(max_age_s=100.0))
    assert fresh.load() == 5
    view = evidence_of(lines.store.since(0.0), Ageing(max_age_s=100.0), now[0])
    assert view[("m", "t")].total == 5


def test_rows_from_another_replica_arriving_late_keep_the_time_order() -> None:
    from cachegw.policies.evidence_window import WindowedEvidence

    w = WindowedEvidence(Ageing(max_age_s=10.0))
    w.add(5.0, 0.9, True)
    w.add(1.0, 0.9, False)  # older, synced later
    assert w.expire(12.0) and w.evidence.total == 1 and w.evidence.wrong[40] == 0
