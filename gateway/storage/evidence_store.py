"""SQL of the false-hit evidence (``hit_audits``): append rows (each logged in the change log, so the
other replicas read it: ``gateway/storage/changes.py``), read rows by id or by age."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session, sessionmaker

from cachegw.gateway.storage.changes import Change, ChangeKind, log_changes
from cachegw.gateway.storage.prune import delete_older
from cachegw.gateway.storage.tables import HitAudit


@dataclass(frozen=True)
class EvidenceRow:
    """One audited pair; ``tenant`` is the tenant's name, as the thresholds name it."""

    model: str
    tenant: str
    score: float
    right: bool
    source: str  # hit | near-miss | feedback | seed
    ts: float
    entry_id: int | None = None
    request_id: str | None = None
    backend_tokens: int = 0
    id: int | None = None
    linked_entry_id: int | None = None  # a right near miss's own stored entry (gateway/cache/links.py)


class EvidenceStore:
    def __init__(self, session: sessionmaker[Session]) -> None:
        self.session = session

    def add(self, rows: list[EvidenceRow]) -> list[int]:
        """Append rows in one transaction; returns their ids."""
        with self.session.begin() as s:
            records = [HitAudit(**{k: v for k, v in asdict(r).items() if k != "id"}) for r in rows]
            s.add_all(records)
            s.flush()
            ids = [r.id for r in records]
            log_changes(s, [Change(ChangeKind.EVIDENCE, i) for i in ids])
            return ids

    def since(self, ts: float) -> list[EvidenceRow]:
        """Rows written at or after ``ts`` (all of them from 0), oldest first."""
        return self._rows(HitAudit.ts >= ts)

    def get(self, ids: list[int]) -> list[EvidenceRow]:
        """The rows of these ids still kept, oldest first."""
        return self._rows(HitAudit.id.in_(ids)) if ids else []

    def _rows(self, where: ColumnElement[bool]) -> list[EvidenceRow]:
        with self.session() as s:
            found = s.scalars(select(HitAudit).where(where).order_by(HitAudit.id)).all()
            return [EvidenceRow(**{f.name: getattr(r, f.name) for f in fields(EvidenceRow)}) for r in found]

    def prune(self, before: float) -> int:
        """Drop rows older than ``before``: the caller keeps every row the evidence window may still
        count (``gateway/cache/retention.py``)."""
        return delete_older(self.session, HitAudit.ts, HitAudit.id, before)

    def backend_tokens(self) -> int:
        """What every audit's re-ask to the backend has cost, over all replicas."""
        with self.session() as s:
            return int(s.scalar(select(func.coalesce(func.sum(HitAudit.backend_tokens), 0))) or 0)
