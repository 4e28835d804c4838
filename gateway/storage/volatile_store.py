"""SQL of the learned volatile templates (``volatile_templates``): every replica adds what it learns
(each new row logged in the change log, so the others read it: ``gateway/storage/changes.py``), reads
them all at start and by id as the log names them; match counts are added in batches. The template
itself is opaque JSON here: the learner encodes and checks it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

from sqlalchemy import Executable, Select, case, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from cachegw.gateway.storage.changes import Change, ChangeKind, log_changes
from cachegw.gateway.storage.tables import VolatileTemplate


@dataclass(frozen=True)
class StoredTemplate:
    tenant: str
    template_id: str
    template: str  # JSON
    learned_at: float
    matches: int = 0
    last_match_at: float | None = None
    id: int | None = None  # the row's, once stored


@dataclass(frozen=True)
class MatchCount:
    """Requests a template moved values for on one replica since its last flush."""

    tenant: str
    template_id: str
    matches: int
    last_match_at: float


class VolatileStore:
    def __init__(self, session: sessionmaker[Session]) -> None:
        self.session = session

    def add(self, rows: Iterable[StoredTemplate]) -> None:
        """Insert each row unless its tenant already has the template: replicas that learn one
        template at once leave one row."""
        for row in rows:
            values = {f.name: getattr(row, f.name) for f in fields(StoredTemplate) if f.name != "id"}
            try:
                with self.session.begin() as s:
                    added = s.execute(_insert_or_ignore(s.get_bind().dialect.name, values)).scalar()
                    if added is not None:  # a new row, not another replica's copy
                        log_changes(s, [Change(ChangeKind.TEMPLATE, int(added))])
            except IntegrityError:  # another database: the unique key refused the second copy
                pass

    def all(self) -> list[StoredTemplate]:
        """Every row, least recently matched (or learned) first, so that keeping the last ones of each
        tenant keeps its most recently used."""
        recency = func.coalesce(VolatileTemplate.last_match_at, VolatileTemplate.learned_at)
        return self._rows(select(VolatileTemplate).order_by(recency, VolatileTemplate.id))

    def get(self, ids: list[int]) -> list[StoredTemplate]:
        """The rows of these ids, oldest first."""
        if not ids:
            return []
        stmt = select(VolatileTemplate).where(VolatileTemplate.id.in_(ids)).order_by(VolatileTemplate.id)
        return self._rows(stmt)

    def add_matches(self, counts: Iterable[MatchCount]) -> None:
        """Add one replica's match counts in one transaction (a row deleted meanwhile is skipped)."""
        t = VolatileTemplate
        with self.session.begin() as s:
            for c in counts:
                later = case(
                    (t.last_match_at.is_(None) | (t.last_match_at < c.last_match_at), c.last_match_at),
                    else_=t.last_match_at,
                )
                s.execute(
                    update(t)
                    .where(t.tenant == c.tenant, t.template_id == c.template_id)
                    .values(matches=t.matches + c.matches, last_match_at=later)
                )

    def _rows(self, stmt: Select[VolatileTemplate]) -> list[StoredTemplate]:
        with self.session() as s:
            return [
                StoredTemplate(**{f.name: getattr(r, f.name) for f in fields(StoredTemplate)})
                for r in s.scalars(stmt)
            ]


def _insert_or_ignore(dialect: str, values: dict[str, object]) -> Executable:
    """The insert, returning the new row's id (none when the row was there already)."""
    new_id = VolatileTemplate.id
    if dialect == "sqlite":
        return sqlite_insert(VolatileTemplate).values(**values).on_conflict_do_nothing().returning(new_id)
    if dialect == "postgresql":
        return pg_insert(VolatileTemplate).values(**values).on_conflict_do_nothing().returning(new_id)
    return insert(VolatileTemplate).values(**values).returning(new_id)
