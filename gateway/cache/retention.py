"""Retention of the tables that grow with traffic: the request log, bad-hit reports, the admin audit
log and the false-hit evidence, pruned by age in the background (``gateway/compose.py``).

The evidence (``hit_audits``) is what the error bound counts (``gateway/cache/error_control.py``), so
it is pruned only where no evidence window can count it: rows older than ``[cache.audits] keep_days``
AND than ``[cache.error_bound] evidence_max_age_s`` plus a day (replica clocks, late syncs). With no
age limit every row may count for ever, and none is deleted. Dropping by age only, never by verdict,
leaves the rows that remain a binomial sample, as the window itself does (policies/evidence_window.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from cachegw.gateway.config import Settings
from cachegw.gateway.storage.admin_store import AdminStore
from cachegw.gateway.storage.evidence_store import EvidenceStore
from cachegw.gateway.storage.recorder import SqlRequestLog
from cachegw.policies.evidence_window import Ageing

log = logging.getLogger("cachegw.gateway")
DAY_S = 86400.0
RETENTION_EVERY_S = 3600.0


def evidence_cutoff(now: float, keep_days: float, ageing: Ageing) -> float | None:
    """The time before which ``hit_audits`` rows may go; None: every row may still count."""
    if keep_days <= 0 or ageing.max_age_s <= 0:
        return None
    return now - max(keep_days * DAY_S, ageing.max_age_s + DAY_S)


def _cutoff(now: float, days: float) -> float | None:
    return now - days * DAY_S if days > 0 else None


@dataclass(frozen=True)
class Pruned:
    """Rows deleted by one round, per table."""

    requests: int = 0
    feedback: int = 0
    audit: int = 0
    hit_audits: int = 0


@dataclass(frozen=True)
class Retention:
    """One round of pruning (``prune``), with the limits read at start."""

    request_log: SqlRequestLog
    admin: AdminStore
    evidence: EvidenceStore
    settings: Settings
    ageing: Ageing  # the window the error bound counts with (``ThresholdProvider.ageing``)
    clock: Callable[[], float]

    def prune(self) -> Pruned:
        now, g = self.clock(), self.settings.gateway
        cut = (
            _cutoff(now, g.request_log_days),
            _cutoff(now, g.feedback_days),
            _cutoff(now, self.settings.admin.audit_log_days),
            evidence_cutoff(now, self.settings.cache.audits.keep_days, self.ageing),
        )
        stores = (
            self.request_log.prune,
            self.admin.prune_feedback,
            self.admin.prune_audit_log,
            self.evidence.prune,
        )
        done = Pruned(*(prune(c) if c is not None else 0 for prune, c in zip(stores, cut, strict=True)))
        if any(vars(done).values()):
            log.info("retention deleted %s", done)
        return done
