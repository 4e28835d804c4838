"""Per scope (model, tenant), the semantic line that keeps the false-hit rate under its target.

The semantic tier asks ``ThresholdProvider.line`` once per lookup; None means the operator set no
target there (``max_false_hit_rate`` 0) and the static thresholds decide, as before. Otherwise the
line comes from ``policies.error_bound.choose_line`` over the scope's evidence: audits (``gateway/
audits.py``), bad-hit reports and seeds from ``cachegw calibrate``. The evidence lives in the
``hit_audits`` table: it survives restarts, and replicas on one database read each other's rows on
the sync cycle (each row is applied once, by id).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gateway.config import CacheConfig
from gateway.evidence_store import EvidenceRow, EvidenceStore
from policies.error_bound import Choice, Evidence, choose_line, interval

SYNC_OVERLAP_S = 60.0  # each sync re-reads this far back: late commits, replica clocks that differ
Scope = tuple[str, str]  # (model, tenant name)


@dataclass(frozen=True)
class ScopeLine:
    """The line in force for one scope: hits need ``score >= line``; with no line, none is served."""

    target: float
    choice: Choice

    @property
    def line(self) -> float | None:
        return self.choice.line

    def serves(self, score: float) -> bool:
        return self.choice.line is not None and score >= self.choice.line


@dataclass(frozen=True)
class RateView:
    """What the stats show of a scope (or of all): the false-hit rate of hits at the line in force."""

    target: float
    line: float | None
    estimate: float | None  # wrong / audits at the line
    interval: tuple[float, float] | None  # two-sided Clopper-Pearson at the configured confidence
    audits: int  # audited pairs at or above the line
    wrong: int
    evidence: int  # every audited pair of the scope, above the line or not

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "line": self.line,
            "estimate": self.estimate,
            "interval": list(self.interval) if self.interval else None,
            "audits": self.audits,
            "wrong": self.wrong,
            "evidence": self.evidence,
        }


def rate_view(
    target: float, line: float | None, wrong: int, audits: int, total: int, conf: float
) -> RateView:
    if audits == 0:
        return RateView(target, line, None, None, 0, 0, total)
    return RateView(target, line, wrong / audits, interval(wrong, audits, conf), audits, wrong, total)


class ThresholdProvider:
    def __init__(self, store: EvidenceStore, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock
        self.evidence: dict[Scope, Evidence] = {}
        self._choices: dict[tuple[Scope, float, float], Choice] = {}
        self._seen: dict[int, float] = {}  # row id -> its ts, for the overlap window only
        self.synced_at = 0.0

    def line(self, model: str, tenant_name: str, config: CacheConfig) -> ScopeLine | None:
        """The semantic tier's one question: which score line holds this scope's target (None: off)."""
        target = config.false_hit_target(model, tenant_name)
        if target <= 0:
            return None
        return ScopeLine(target, self._choice((model, tenant_name), target, config.false_hit_confidence))

    def _choice(self, scope: Scope, target: float, conf: float) -> Choice:
        key = (scope, target, conf)
        if key not in self._choices:
            self._choices[key] = choose_line(self.evidence.get(scope, Evidence()), target, conf)
        return self._choices[key]

    def apply(self, rows: list[EvidenceRow]) -> int:
        """Count rows not counted yet (by id); returns how many were new."""
        new = 0
        for r in rows:
            if r.id is not None:
                if r.id in self._seen:
                    continue
                self._seen[r.id] = r.ts
            scope = (r.model, r.tenant)
            self.evidence.setdefault(scope, Evidence()).add(r.score, r.right)
            self._choices = {k: v for k, v in self._choices.items() if k[0] != scope}
            new += 1
        return new

    def load(self) -> int:
        """Everything in the database (at start)."""
        self.synced_at = self.clock()
        return self.apply(self.store.since(0.0))

    async def sync(self) -> int:
        """Rows other replicas wrote since the last look."""
        now = self.clock()
        rows = await asyncio.to_thread(self.store.since, self.synced_at - SYNC_OVERLAP_S)
        self.synced_at = now
        old = now - 2 * SYNC_OVERLAP_S
        self._seen = {i: ts for i, ts in self._seen.items() if ts >= old}
        return self.apply(rows)

    async def record(self, rows: list[EvidenceRow]) -> None:
        """Persist new evidence, then count it here (other replicas count it on their next sync)."""
        ids = await asyncio.to_thread(self.store.add, rows)
        self.apply([replace(r, id=i) for r, i in zip(rows, ids, strict=True)])

    def view(self, config: CacheConfig) -> dict[str, Any]:
        """``false_hit_rate`` of /admin/api/stats: per scope ("model|tenant") and overall."""
        return rates(self.evidence, config, self.line)


def rates(
    evidence: dict[Scope, Evidence],
    config: CacheConfig,
    line_of: Callable[[str, str, CacheConfig], ScopeLine | None] | None = None,
) -> dict[str, Any]:
    """Per scope and overall: the audited false-hit rate of hits at each scope's line in force
    (``line_of``; by default computed from ``evidence`` itself, as ``cachegw analyze`` does)."""
    conf = config.false_hit_confidence

    def own_line(model: str, tenant: str, c: CacheConfig) -> ScopeLine | None:
        target = c.false_hit_target(model, tenant)
        return ScopeLine(target, choose_line(evidence[(model, tenant)], target, conf)) if target > 0 else None

    line_of = line_of or own_line
    scopes: dict[str, Any] = {}
    wrong_all = audits_all = total_all = 0
    for (model, tenant), ev in sorted(evidence.items()):
        sl = line_of(model, tenant, config)
        target = sl.target if sl else 0.0
        line = sl.line if sl else None
        wrong, n = ev.at(line) if line is not None else (0, 0)
        scopes[f"{model}|{tenant}"] = rate_view(target, line, wrong, n, ev.total, conf).as_dict()
        wrong_all, audits_all, total_all = wrong_all + wrong, audits_all + n, total_all + ev.total
    overall = rate_view(config.max_false_hit_rate, None, wrong_all, audits_all, total_all, conf)
    return {"overall": overall.as_dict(), "by_scope": scopes, "confidence": conf}


def evidence_of(rows: list[EvidenceRow]) -> dict[Scope, Evidence]:
    out: dict[Scope, Evidence] = {}
    for r in rows:
        out.setdefault((r.model, r.tenant), Evidence()).add(r.score, r.right)
    return out


def history(
    rows: list[EvidenceRow], since: float, until: float, bucket_s: float, conf: float
) -> list[dict[str, Any]]:
    """The audited false-hit rate of served hits (hit audits and bad-hit reports) over the window,
    cumulative at the end of each bucket: the dashboard's chart against the target line."""
    served = sorted(
        (r.ts, r.right) for r in rows if r.source in ("hit", "feedback") and since <= r.ts < until
    )
    points: list[dict[str, Any]] = []
    wrong = n = i = 0
    t = since + bucket_s
    while t < until + bucket_s:
        while i < len(served) and served[i][0] < t:
            wrong, n, i = wrong + (not served[i][1]), n + 1, i + 1
        view = rate_view(0.0, None, wrong, n, n, conf)
        points.append(
            {
                "t": min(t, until),
                "estimate": view.estimate,
                "interval": view.as_dict()["interval"],
                "audits": n,
            }
        )
        t += bucket_s
    return points
