"""Per scope (model, tenant), the semantic line that keeps the false-hit rate under its target.

The semantic tier asks ``ThresholdProvider.line`` once per lookup; None means the operator set no
target there (``max_false_hit_rate`` 0) and the static thresholds decide, as before. Otherwise the
line comes from ``policies.error_bound.choose_line`` over the scope's evidence: audits (``gateway/
audits.py``), bad-hit reports and seeds from ``cachegw calibrate``. The evidence lives in the
``hit_audits`` table: it survives restarts, and replicas on one database read each other's rows as
the change log names them (``logged``; each row is applied once, by id).

Per entry: an entry with at least ``min_audits(target)`` audits and reports of its own (59 at a 5%
target, 149 at 2%, at 95% confidence: the fewest that can pass with no wrong one) gets its own line
from its own evidence, by the same fixed-sequence test; one with fewer is judged by its scope's line.
An entry whose own evidence fails the bound serves no semantic hit however good its scope. Each
entry's line holds for that entry's hits at the stated confidence (a per-entry guarantee, not a joint
one over all entries); the scope's line keeps holding for the hits it decides.

Evidence ages (``[cache] evidence_max_age_s``, ``evidence_max_audits``: ``policies/evidence_window.py``):
the same window applies to each scope and each entry.

A prior (``false_hit_prior``, ``policies/bound_prior.py``) adds pseudo-audits to each scope's evidence,
of the score kind the scope is judged on (the verifier's probability, or the cosine with it off), with
a weight that falls to none as the scope's live audits reach ``false_hit_prior_fade``; an entry's own
line never counts it. The prior's calibration families (QQP questions, banking77 intents) are
weighed per scope by its own audits (``policies/prior_families.py``), and the prior is dropped when
the scope's live audits at the line contradict it (``bound_prior.contradicts``). A request may
tighten its scope's target (``x-cache-max-false-hit-rate``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from cachetools import FIFOCache

from cachegw.configtools.lru import Lru
from cachegw.gateway.cache.links import EntryLinks
from cachegw.gateway.cache.prior_loader import Priors
from cachegw.gateway.config import CacheConfig
from cachegw.gateway.storage.evidence_store import EvidenceRow, EvidenceStore
from cachegw.policies.bound_prior import START_FACTOR, PriorWeight, contradicts, with_prior
from cachegw.policies.error_bound import Choice, Evidence, choose_line, interval, min_audits
from cachegw.policies.evidence_window import Ageing, WindowedEvidence
from cachegw.policies.prior_families import resembled

SEEN_IDS = 200_000  # evidence ids counted here, remembered so a row the log names again is not recounted
CHOICES = 4096  # cached line choices at most (requests' own targets could grow it without end)
ENTRIES = 20_000  # entries whose own evidence is kept (least recently audited dropped: the scope decides)
Scope = tuple[str, str]  # (model, tenant name)
ScopedChoice = tuple[Choice, float, dict[str, float]]  # the line, the prior's pseudo-audits, its families


def _no_entry_line(entry_id: int | None) -> Choice | None:
    return None


@dataclass(frozen=True)
class ScopeLine:
    """The line in force for one scope: hits need ``score >= line``; with no line, none is served."""

    target: float
    choice: Choice
    # an entry's own choice when it has enough evidence of its own, else None (the scope's decides)
    own: Callable[[int | None], Choice | None] = field(default=_no_entry_line, compare=False)
    prior: float = 0.0  # pseudo-audits of the prior in the scope's evidence (0: live evidence alone)
    families: dict[str, float] = field(default_factory=dict, compare=False)  # the prior's family weights

    @property
    def line(self) -> float | None:
        return self.choice.line

    def serves(self, score: float, entry_id: int | None = None) -> bool:
        choice = self.own(entry_id) or self.choice
        return choice.line is not None and score >= choice.line


@dataclass(frozen=True)
class RateView:
    """What the stats show of a scope (or of all): the false-hit rate of hits at the line in force."""

    target: float
    line: float | None
    estimate: float | None  # wrong / audits at the line
    interval: tuple[float, float] | None  # two-sided Clopper-Pearson at the configured confidence
    audits: float  # audited pairs at or above the line (live ones: whole numbers)
    wrong: float
    evidence: float  # every audited pair of the scope, above the line or not

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
    target: float, line: float | None, wrong: float, audits: float, total: float, conf: float
) -> RateView:
    if audits == 0:
        return RateView(target, line, None, None, 0, 0, total)
    return RateView(target, line, wrong / audits, interval(wrong, audits, conf), audits, wrong, total)


class ThresholdProvider:
    def __init__(
        self,
        store: EvidenceStore,
        clock: Callable[[], float],
        ageing: Ageing | None = None,
        priors: Priors | None = None,
    ) -> None:
        """``priors``: the prior's counts per score kind (``prior_loader.load_priors``; none: live only)."""
        self.store = store
        self.priors = priors or {}
        self.clock = clock
        self.ageing = ageing or Ageing()
        self.windows: dict[Scope, WindowedEvidence] = {}
        # per entry, the least recently audited evicted first (the scope's line then decides for it)
        self.entries: Lru[int, WindowedEvidence] = Lru(ENTRIES, self._evicted)
        self.entry_scope: dict[int, Scope] = {}
        self._choices: dict[tuple[int, float, float, float], Choice] = {}  # entries' own lines
        # per (scope, target, confidence, score kind, prior weight): the choice, pseudo-audits, families
        self._scoped: dict[tuple[Scope, float, float, str, PriorWeight], ScopedChoice] = {}
        # ids counted here, oldest first: this replica's own rows come back through the change log
        self._seen: FIFOCache[int, None] = FIFOCache(SEEN_IDS)
        self.links = EntryLinks()  # near misses that became hits: read from the same rows

    @property
    def evidence(self) -> dict[Scope, Evidence]:
        return {scope: w.evidence for scope, w in self.windows.items()}

    def line(
        self, model: str, tenant_name: str, config: CacheConfig, cap: float | None = None
    ) -> ScopeLine | None:
        """The semantic tier's one question: which score line holds this scope's target (None: off).
        ``cap``: the request's own target, which may only tighten the configured one (or set one)."""
        target = config.error_bound.false_hit_target(model, tenant_name)
        if cap is not None:
            target = cap if target <= 0 else min(target, cap)
        if target <= 0:
            return None
        conf = config.error_bound.false_hit_confidence
        scope = (model, tenant_name)
        window = self.windows.get(scope)
        if window is not None and window.expire(self.clock()):
            self._forget(scope)
        live = window.evidence if window is not None else Evidence()
        kind = "verifier" if config.verifier.enabled else "cosine"
        k = (scope, target, conf, kind, config.error_bound.prior_weight)
        if k not in self._scoped:
            if len(self._scoped) >= CHOICES:
                self._scoped.clear()
            self._scoped[k] = self._scope_choice(live, kind, target, conf, k[4])
        choice, prior, families = self._scoped[k]

        def own(entry_id: int | None) -> Choice | None:
            return self._entry_choice(entry_id, target, conf)

        return ScopeLine(target, choice, own, prior, families)

    def _scope_choice(
        self, live: Evidence, kind: str, target: float, conf: float, weight: PriorWeight
    ) -> ScopedChoice:
        """The line from live evidence plus the prior its audits point to, unless they contradict it."""
        mix = resembled(live, self.priors.get(kind) or {})
        ev, prior = with_prior(live, mix.counts if mix else None, weight)
        start = START_FACTOR * min_audits(target, conf) if prior > 0 else 0.0
        choice = choose_line(ev, target, conf, start)
        if mix is None or prior == 0.0:
            return choice, 0.0, {}
        if choice.line is not None and contradicts(live, mix.counts, choice.line, target, conf):
            return choose_line(live, target, conf), 0.0, {}  # its own audits reject the prior
        return choice, prior, mix.weights

    def _choice(self, key: int, ev: Evidence, target: float, conf: float) -> Choice:
        """An entry's own line (its own evidence; no prior), cached until its evidence changes."""
        k = (key, target, conf, 0.0)
        if k not in self._choices:
            if len(self._choices) >= CHOICES:
                self._choices.clear()
            self._choices[k] = choose_line(ev, target, conf)
        return self._choices[k]

    def _entry_choice(self, entry_id: int | None, target: float, conf: float) -> Choice | None:
        window = self.entries.peek(entry_id) if entry_id is not None else None  # a lookup, not an audit
        if window is None or entry_id is None:
            return None
        if window.expire(self.clock()):
            self._forget(entry_id)
        if window.evidence.total < min_audits(target, conf):
            return None  # too little of its own: the scope's line decides
        return self._choice(entry_id, window.evidence, target, conf)

    def _evicted(self, entry_id: int, _: WindowedEvidence) -> None:
        """An entry's own evidence left (``ENTRIES``): its scope's line decides for it from now on."""
        self.entry_scope.pop(entry_id, None)
        self._forget(entry_id)

    def _forget(self, key: Scope | int) -> None:
        self._choices = {k: v for k, v in self._choices.items() if k[0] != key}
        self._scoped = {k: v for k, v in self._scoped.items() if k[0] != key}

    def apply(self, rows: list[EvidenceRow]) -> int:
        """Count rows not counted yet (by id); returns how many were new."""
        new = 0
        for r in rows:
            if r.id is not None:
                if r.id in self._seen:
                    continue
                self._seen[r.id] = None  # the oldest id leaves past SEEN_IDS
            self.links.apply((r,))
            scope = (r.model, r.tenant)
            self.windows.setdefault(scope, WindowedEvidence(self.ageing)).add(r.ts, r.score, r.right)
            self._forget(scope)
            if r.entry_id is not None:
                window = self.entries.get(r.entry_id) or WindowedEvidence(self.ageing)
                self.entries[r.entry_id] = window  # the most recently audited (past ENTRIES, one leaves)
                window.add(r.ts, r.score, r.right)
                self._forget(r.entry_id)
                self.entry_scope[r.entry_id] = scope
            new += 1
        return new

    def load(self) -> int:
        """Everything in the database still inside the ageing window (at start)."""
        now = self.clock()
        start = now - self.ageing.max_age_s if self.ageing.max_age_s > 0 else 0.0
        return self.apply(self.store.since(start))

    async def logged(self, ids: list[int]) -> int:
        """Rows any replica wrote, named by the change log (``gateway/cache/sync.py``)."""
        return self.apply(await asyncio.to_thread(self.store.get, ids))

    async def reload(self) -> int:
        """Count everything again from the database (the change log was pruned past this replica)."""
        self.windows.clear()
        self.entries.clear()
        self.entry_scope.clear()
        self._seen.clear()
        self._choices.clear()
        self._scoped.clear()
        self.links.clear()
        return await asyncio.to_thread(self.load)

    async def record(self, rows: list[EvidenceRow]) -> None:
        """Persist new evidence, then count it here (other replicas count it on their next sync)."""
        ids = await asyncio.to_thread(self.store.add, rows)
        self.apply([replace(r, id=i) for r, i in zip(rows, ids, strict=True)])

    def view(self, config: CacheConfig) -> dict[str, Any]:
        """``false_hit_rate`` of /admin/api/stats: per scope ("model|tenant") and overall."""
        now = self.clock()
        for scope, window in self.windows.items():
            if window.expire(now):
                self._forget(scope)
        view = rates(self.evidence, config, self.line)
        own: dict[str, int] = {}
        for entry_id, window in self.entries.peek_items():  # items() would make each recently audited
            model, tenant = self.entry_scope[entry_id]
            target = config.error_bound.false_hit_target(model, tenant)
            if target > 0 and window.evidence.total >= min_audits(
                target, config.error_bound.false_hit_confidence
            ):
                own[f"{model}|{tenant}"] = own.get(f"{model}|{tenant}", 0) + 1
        for key, shown in view["by_scope"].items():
            shown["entries_with_own_line"] = own.get(key, 0)
        return view


def rates(
    evidence: dict[Scope, Evidence],
    config: CacheConfig,
    line_of: Callable[[str, str, CacheConfig], ScopeLine | None] | None = None,
) -> dict[str, Any]:
    """Per scope and overall: the audited false-hit rate of hits at each scope's line in force
    (``line_of``; by default computed from ``evidence`` itself, as ``cachegw analyze`` does)."""
    conf = config.error_bound.false_hit_confidence

    def own_line(model: str, tenant: str, c: CacheConfig) -> ScopeLine | None:
        target = c.error_bound.false_hit_target(model, tenant)
        return ScopeLine(target, choose_line(evidence[(model, tenant)], target, conf)) if target > 0 else None

    line_of = line_of or own_line
    scopes: dict[str, Any] = {}
    wrong_all: float = 0
    audits_all: float = 0
    total_all: float = 0
    for (model, tenant), ev in sorted(evidence.items()):
        sl = line_of(model, tenant, config)
        target = sl.target if sl else 0.0
        line = sl.line if sl else None
        wrong, n = ev.at(line) if line is not None else (0, 0)
        scopes[f"{model}|{tenant}"] = {
            **rate_view(target, line, wrong, n, ev.total, conf).as_dict(),
            "prior_audits": round(sl.prior, 1) if sl else 0.0,
            "prior_families": {k: round(w, 3) for k, w in sl.families.items()} if sl else {},
        }
        wrong_all, audits_all, total_all = wrong_all + wrong, audits_all + n, total_all + ev.total
    overall = rate_view(config.error_bound.max_false_hit_rate, None, wrong_all, audits_all, total_all, conf)
    return {"overall": overall.as_dict(), "by_scope": scopes, "confidence": conf}


def evidence_of(rows: list[EvidenceRow], ageing: Ageing, now: float) -> dict[Scope, Evidence]:
    """Per scope, the evidence the gateway's window holds at ``now`` (``cachegw analyze``'s view)."""
    out: dict[Scope, WindowedEvidence] = {}
    for r in sorted(rows, key=lambda r: r.ts):
        out.setdefault((r.model, r.tenant), WindowedEvidence(ageing)).add(r.ts, r.score, r.right)
    for window in out.values():
        window.expire(now)
    return {scope: w.evidence for scope, w in out.items()}


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
