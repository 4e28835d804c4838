"""What the gateway learned about volatile spans, per tenant: recent system prompts and templates.

Why here: learning needs state across requests, and the policy (``policies/volatile.py``) stays
pure; it is given a tenant's templates and hands back the system prompts no template matched, which
are learned from. Tenants never share state (another tenant's prompts never teach a template).
Bounded: ``samples`` distinct prompts and ``templates`` templates per tenant, ``tenants`` tenants,
least recently used dropped first. In memory, per replica: a restart learns again from traffic.
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
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._tenants: OrderedDict[str, _TenantState] = OrderedDict()
        self._lock = threading.Lock()  # observe runs in worker threads

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
        new = False
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
                    new = True
                while len(state.samples) > cfg.samples:
                    state.samples.popitem(last=False)
                while len(state.templates) > cfg.templates:
                    state.templates.popitem(last=False)
            if new:
                self._snap(state)
        return new

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
