"""SQL of the false-hit evidence (``hit_audits``): append rows, read what others appended since."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

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


class EvidenceStore:
    def __init__(self, session: sessionmaker[Session]) -> None:
        self.session = session

    def add(self, rows: list[EvidenceRow]) -> list[int]:
        """Append rows in one transaction; returns their ids."""
        with self.session.begin() as s:
            records = [HitAudit(**{k: v for k, v in asdict(r).items() if k != "id"}) for r in rows]
            s.add_all(records)
            s.flush()
            return [r.id for r in records]

    def since(self, ts: float) -> list[EvidenceRow]:
        """Rows written at or after ``ts`` (all of them from 0), oldest first."""
        with self.session() as s:
            found = s.scalars(select(HitAudit).where(HitAudit.ts >= ts).order_by(HitAudit.id)).all()
            return [EvidenceRow(**{f.name: getattr(r, f.name) for f in fields(EvidenceRow)}) for r in found]

    def prune(self, before: float) -> int:
        """Drop rows older than ``before``: the caller keeps every row the evidence window may still
        count (``gateway/cache/retention.py``)."""
        return delete_older(self.session, HitAudit.ts, HitAudit.id, before)

    def backend_tokens(self) -> int:
        """What every audit's re-ask to the backend has cost, over all replicas."""
        with self.session() as s:
            return int(s.scalar(select(func.coalesce(func.sum(HitAudit.backend_tokens), 0))) or 0)
