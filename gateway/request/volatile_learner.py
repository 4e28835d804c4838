"""What the gateway learned about volatile spans, per tenant: recent system prompts and templates.

Why here: learning needs state across requests, and the policy (``policies/volatile.py``) stays
pure; it is given a tenant's templates and hands back the system prompts no template matched, which
are learned from. Tenants never share state (another tenant's prompts never teach a template).
Bounded: ``samples`` distinct prompts and ``templates`` templates per tenant, ``tenants`` tenants,
least recently used dropped first.

Shared through the database when given a store: every template learned is written (one row per tenant
and template, whichever replica learns it first, logged in the change log), a replica starts with the
stored ones and ``logged`` adds those the others learned as the log names them. Match counts are this
replica's in memory (plus what the stored row said when it was read) and are added to the stored row
in batches (``flush_matches``); at start the most recently matched templates of a tenant are kept.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachegw.gateway.request.volatile_sharing import decode, encode
from cachegw.gateway.storage.volatile_store import MatchCount, StoredTemplate, VolatileStore
from cachegw.policies.canonicalize import Canonical, Restore, canonicalize_detail
from cachegw.policies.canonicalize_config import CanonicalizeConfig
from cachegw.policies.volatile import LearnConfig, Moved, Template, learn

log = logging.getLogger("cachegw.volatile")


@dataclass
class LearnedTemplate:
    template: Template
    learned_at: float
    matches: int = 0
    last_match_at: float | None = None


@dataclass
class _TenantState:
    """Ordered dicts, not ``configtools.lru.Lru`` (as the tenants too): they are bounded by the
    ``[canonicalize.learn]`` in force at each call, and read newest first, an order cachetools keeps
    to itself."""

    samples: OrderedDict[str, None] = field(default_factory=OrderedDict)  # oldest first
    templates: OrderedDict[str, LearnedTemplate] = field(default_factory=OrderedDict)  # LRU first
    snapshot: tuple[Template, ...] = ()  # most recently matched first: what requests are given


@dataclass(frozen=True)
class SpanView:
    label: str
    before: str  # the constant text just before the value
    after: str  # and just after it


@dataclass(frozen=True)
class TemplateView:
    id: str
    spans: tuple[SpanView, ...]
    prompt_chars: int  # of constant text
    learned_at: float
    matches: int
    last_match_at: float | None


class VolatileLearner:
    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        store: VolatileStore | None = None,
        config: Callable[[], LearnConfig] = LearnConfig,
    ) -> None:
        """``store``: share templates with the other replicas (None: this replica's memory only);
        ``config``: the ``[canonicalize.learn]`` in force, whose bounds the stored templates obey."""
        self._clock = clock
        self._store = store
        self._config = config
        self._tenants: OrderedDict[str, _TenantState] = OrderedDict()
        self._lock = threading.Lock()  # observe runs in worker threads
        self._unflushed: dict[tuple[str, str], MatchCount] = {}

    async def canonicalize(
        self, tenant: str, body: dict[str, Any], cfg: CanonicalizeConfig, restore: Restore, learn: bool = True
    ) -> Canonical:
        """The canonical body with the tenant's templates; system prompts none matched are learned from
        (unless ``learn`` is False), and a template learned from this very request applies to it at once."""
        # restoring earlier replies reads the database: off the event loop
        slow = any(isinstance(m, dict) and m.get("role") == "assistant" for m in body.get("messages") or [])

        async def run(templates: tuple[Template, ...]) -> Canonical:
            if slow:
                return await asyncio.to_thread(canonicalize_detail, body, cfg, restore, templates)
            return canonicalize_detail(body, cfg, restore, templates)  # pure, about 0.1 ms

        canon = await run(self.templates(tenant))
        if learn and canon.unmatched and not self.known(tenant, canon.unmatched, cfg.learn):
            # aligning against recent prompts takes milliseconds: off the event loop
            try:
                learned = await asyncio.to_thread(self.observe, tenant, canon.unmatched, cfg.learn)
            except Exception:  # learning is an optimisation: it must never fail a request
                log.exception("volatile learning failed; the request goes on as canonicalized")
                learned = False
            if learned:
                canon = await run(self.templates(tenant))
        self.matched(tenant, canon.moved)
        return canon

    def templates(self, tenant: str) -> tuple[Template, ...]:
        """The tenant's templates, most recently matched first (an immutable snapshot)."""
        state = self._tenants.get(tenant)
        return state.snapshot if state is not None else ()

    def known(self, tenant: str, texts: Iterable[str], cfg: LearnConfig) -> bool:
        """Whether there is nothing to learn from ``texts`` (repeats of kept prompts, or too long):
        the cheap check the request path makes before handing them to ``observe``."""
        state = self._tenants.get(tenant)
        return all(len(t) > cfg.max_prompt_chars or (state is not None and t in state.samples) for t in texts)

    def observe(self, tenant: str, texts: Sequence[str], cfg: LearnConfig) -> bool:
        """Learn from system prompts no template matched; True if a new template was learned."""
        new: list[LearnedTemplate] = []
        with self._lock:
            state = self._tenants.pop(tenant, None) or _TenantState()
            self._tenants[tenant] = state  # most recently seen last
            while len(self._tenants) > cfg.tenants:
                self._tenants.popitem(last=False)
            for text in texts:
                if len(text) > cfg.max_prompt_chars:
                    continue
                if text in state.samples:
                    state.samples.move_to_end(text)
                    continue
                template = learn(text, list(reversed(state.samples)), cfg)
                state.samples[text] = None
                if template is not None and template.id not in state.templates:
                    # the prompts it was learned from stay: with a value in a span the template
                    # holds constant, the next prompt learns a wider template from them at once
                    state.templates[template.id] = LearnedTemplate(template, self._clock())
                    new.append(state.templates[template.id])
                while len(state.samples) > cfg.samples:
                    state.samples.popitem(last=False)
                while len(state.templates) > cfg.templates:
                    state.templates.popitem(last=False)
            if new:
                self._snap(state)
        if new and self._store is not None:
            rows = [StoredTemplate(tenant, e.template.id, encode(e.template), e.learned_at) for e in new]
            try:
                self._store.add(rows)
            except Exception:  # the other replicas learn it themselves then
                log.exception("could not store %d learned template(s) of tenant %s", len(rows), tenant)
        return bool(new)

    def load(self) -> int:
        """The stored templates of every tenant, within ``[canonicalize.learn]``'s bounds (the most
        recently matched kept): a new replica starts warm. Blocking; the number read."""
        if self._store is None:
            return 0
        rows = self._store.all()
        self._adopt(rows)
        return len(rows)

    async def flush_matches(self) -> None:
        """Store this replica's match counts since the last flush (a failed write loses them: they only
        order templates)."""
        if self._store is None:
            return
        with self._lock:
            counts, self._unflushed = list(self._unflushed.values()), {}
        if counts:
            try:
                await asyncio.to_thread(self._store.add_matches, counts)
            except Exception:
                log.exception("could not store the match counts of %d volatile template(s)", len(counts))

    async def logged(self, ids: list[int]) -> int:
        """Templates any replica stored, named by the change log (``gateway/cache/sync.py``)."""
        if self._store is None:
            return 0
        rows = await asyncio.to_thread(self._store.get, ids)
        self._adopt(rows)
        return len(rows)

    async def reload(self) -> int:
        """Read every stored template again (the change log was pruned past this replica); those held
        already are kept as they are."""
        return await asyncio.to_thread(self.load)

    def _adopt(self, rows: Iterable[StoredTemplate]) -> None:
        """Add stored templates this replica does not hold; a row that is not a template is skipped."""
        cfg = self._config()
        with self._lock:
            changed: dict[int, _TenantState] = {}
            for row in rows:
                state = self._tenants.get(row.tenant)
                if state is not None and row.template_id in state.templates:
                    continue
                try:
                    template = decode(row)
                except ValueError as e:
                    log.warning(
                        "skipped stored volatile template row %s (tenant %s): %s", row.id, row.tenant, e
                    )
                    continue
                state = self._tenants.pop(row.tenant, None) or _TenantState()
                self._tenants[row.tenant] = state  # most recently seen last
                while len(self._tenants) > cfg.tenants:
                    self._tenants.popitem(last=False)
                state.templates[template.id] = LearnedTemplate(
                    template, row.learned_at, row.matches, row.last_match_at
                )
                while len(state.templates) > cfg.templates:
                    state.templates.popitem(last=False)
                changed[id(state)] = state
            for state in changed.values():
                self._snap(state)

    def matched(self, tenant: str, moved: Iterable[Moved]) -> None:
        """Count the templates a request's values were moved by (keeps them from being dropped)."""
        ids = {m.name for m in moved if m.kind == "learned"}
        state = self._tenants.get(tenant)
        if not ids or state is None:
            return
        with self._lock:
            now = self._clock()
            for tid in ids:
                entry = state.templates.get(tid)
                if entry is not None:
                    entry.matches += 1
                    entry.last_match_at = now
                    state.templates.move_to_end(tid)
                    if self._store is not None:
                        n = self._unflushed.get((tenant, tid))
                        self._unflushed[tenant, tid] = MatchCount(tenant, tid, n.matches + 1 if n else 1, now)
            if state.snapshot and state.snapshot[0].id not in ids:
                self._snap(state)

    @staticmethod
    def _snap(state: _TenantState) -> None:
        state.snapshot = tuple(e.template for e in reversed(state.templates.values()))

    def view(self) -> dict[str, tuple[TemplateView, ...]]:
        """Per tenant id: its templates, most recently matched first (for the admin API)."""
        with self._lock:
            return {
                tenant: tuple(_view(e) for e in reversed(state.templates.values()))
                for tenant, state in self._tenants.items()
                if state.templates
            }

    def sample_count(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return len(state.samples) if state is not None else 0


def _view(e: LearnedTemplate) -> TemplateView:
    parts = e.template.parts
    spans = tuple(
        SpanView(label, parts[i][-40:], parts[i + 1][:40]) for i, label in enumerate(e.template.labels)
    )
    return TemplateView(e.template.id, spans, e.template.size, e.learned_at, e.matches, e.last_match_at)
