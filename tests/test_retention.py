"""Retention of the growing tables (gateway/cache/retention.py): rows older than their limit go, recent
rows stay, on SQLite and on a real PostgreSQL; the false-hit evidence goes only where no evidence window
could count it, so the error bound reads the same evidence before and after a prune."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from cachegw.gateway.cache.error_control import ThresholdProvider
from cachegw.gateway.cache.retention import DAY_S, Pruned, Retention, evidence_cutoff
from cachegw.gateway.config import Settings, load_settings
from cachegw.gateway.storage import prune as prune_module
from cachegw.gateway.storage.admin_store import AdminStore
from cachegw.gateway.storage.evidence_store import EvidenceRow, EvidenceStore
from cachegw.gateway.storage.recorder import SqlRequestLog
from cachegw.gateway.storage.store import Store
from cachegw.gateway.storage.tables import AuditEvent, Feedback, HitAudit, RequestRow
from cachegw.policies.evidence_window import Ageing
from tests.test_shared_store import fresh_database

NOW = 1_800_000_000.0
AGES_DAYS = (400, 100, 40, 20, 5, 0.5)  # one row of each table at each age


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'retention.db'}"
    return fresh_database(request.getfixturevalue("postgres"))


def settings(**limits: float) -> Settings:
    """config.toml's settings with retention limits: request_log_days, feedback_days (gateway),
    audit_log_days (admin), keep_days (cache.audits)."""
    s = load_settings(None)
    g = {k: v for k, v in limits.items() if k in ("request_log_days", "feedback_days")}
    admin = s.admin.model_copy(update={k: v for k, v in limits.items() if k == "audit_log_days"})
    audits = s.cache.audits.model_copy(update={k: v for k, v in limits.items() if k == "keep_days"})
    cache = s.cache.model_copy(update={"audits": audits})
    return s.model_copy(update={"gateway": s.gateway.model_copy(update=g), "admin": admin, "cache": cache})


def fill(store: Store) -> None:
    """One request, admin event, report and piece of evidence at each age of ``AGES_DAYS``."""
    rows = [
        EvidenceRow("m", "t", 0.9 + i / 100, i % 2 == 0, "hit", NOW - d * DAY_S)
        for i, d in enumerate(AGES_DAYS)
    ]
    EvidenceStore(store.session).add(rows)
    with store.session.begin() as s:
        for d in AGES_DAYS:
            ts = NOW - d * DAY_S
            s.add(
                RequestRow(id=f"req-{d}", ts=ts, tenant="t", model="m", endpoint="chat", stream=False,
                           cache_result="miss", total_ms=1.0, status=200, rules_fired="")
            )  # fmt: skip
            s.add(AuditEvent(ts=ts, actor="admin", action="settings", target=""))
            s.add(Feedback(ts=ts, entry_id=1, tenant="t", actor="admin", verdict="bad", action=""))


def ages(store: Store, ts_column) -> list[float]:
    with store.session() as s:
        return sorted(round((NOW - t) / DAY_S, 1) for t in s.scalars(select(ts_column)))


def retention(store: Store, s: Settings, ageing: Ageing) -> Retention:
    ev = EvidenceStore(store.session)
    return Retention(SqlRequestLog(store.session), AdminStore(store.session), ev, s, ageing, lambda: NOW)


def test_old_rows_go_and_recent_rows_stay(url: str) -> None:
    store = Store(url, clock=lambda: NOW)
    try:
        fill(store)
        s = settings(request_log_days=30, feedback_days=90, audit_log_days=365, keep_days=10)
        month = Ageing(max_age_s=30 * DAY_S)
        done = retention(store, s, month).prune()
        # evidence: older than keep_days (10) AND than the window's age plus a day (31): 40 days and over
        assert done == Pruned(requests=3, feedback=2, audit=1, hit_audits=3)
        assert ages(store, RequestRow.ts) == [0.5, 5, 20]
        assert ages(store, Feedback.ts) == [0.5, 5, 20, 40]
        assert ages(store, AuditEvent.ts) == [0.5, 5, 20, 40, 100]
        assert ages(store, HitAudit.ts) == [0.5, 5, 20]
        assert retention(store, s, month).prune() == Pruned()  # a second round finds nothing
    finally:
        store.close()


def test_zero_keeps_every_row(url: str) -> None:
    store = Store(url, clock=lambda: NOW)
    try:
        fill(store)
        s = settings(request_log_days=0, feedback_days=0, audit_log_days=0, keep_days=0)
        assert retention(store, s, Ageing(max_age_s=DAY_S)).prune() == Pruned()
        assert len(ages(store, RequestRow.ts)) == len(AGES_DAYS)
    finally:
        store.close()


def test_evidence_is_kept_while_any_window_can_count_it(tmp_path: Path) -> None:
    """The error bound's evidence (hit_audits): never pruned when it does not age by time; else only
    past the window, so a replica starting after the prune counts exactly what it counted before."""
    assert evidence_cutoff(NOW, 10, Ageing()) is None  # no age limit: every row may count for ever
    assert evidence_cutoff(NOW, 10, Ageing(max_audits=100)) is None  # a count window reaches back any age
    assert evidence_cutoff(NOW, 0, Ageing(max_age_s=DAY_S)) is None  # keep_days 0: kept
    assert evidence_cutoff(NOW, 10, Ageing(max_age_s=30 * DAY_S)) == NOW - 31 * DAY_S
    assert evidence_cutoff(NOW, 60, Ageing(max_age_s=30 * DAY_S)) == NOW - 60 * DAY_S
    store = Store(f"sqlite:///{tmp_path / 'ev.db'}", clock=lambda: NOW)
    try:
        fill(store)
        for ageing in (Ageing(max_age_s=30 * DAY_S), Ageing(max_age_s=30 * DAY_S, max_audits=2), Ageing()):
            before = ThresholdProvider(EvidenceStore(store.session), lambda: NOW, ageing)
            before.load()
            retention(store, settings(keep_days=1), ageing).prune()
            after = ThresholdProvider(EvidenceStore(store.session), lambda: NOW, ageing)
            after.load()
            assert after.evidence == before.evidence and sum(after.evidence[("m", "t")].audits) > 0
    finally:
        store.close()


def test_large_prunes_go_in_batches(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each batch is its own short transaction; every old row still goes."""
    monkeypatch.setattr(prune_module, "BATCH", 2)
    store = Store(url, clock=lambda: NOW)
    try:
        fill(store)
        assert SqlRequestLog(store.session).prune(NOW - 1 * DAY_S) == 5
        assert ages(store, RequestRow.ts) == [0.5]
    finally:
        store.close()
