"""The admin side of the database: run-time settings, audit log, feedback, entry search, and the
request log read back for statistics. Same engine and sessions as ``Store``; synchronous and short,
called from worker threads."""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import func, literal, or_, select
from sqlalchemy.orm import Session, sessionmaker

from cachegw.gateway.storage.changes import Change, ChangeKind, log_changes
from cachegw.gateway.storage.prune import delete_older
from cachegw.gateway.storage.request_record import COLUMNS, RequestRecord
from cachegw.gateway.storage.tables import AuditEvent, CacheEntry, Feedback, RequestRow, Setting

ENTRY_ORDER = {
    "hits": (CacheEntry.hit_count.desc(), CacheEntry.id.desc()),
    "recent": (CacheEntry.id.desc(),),
    "last_hit": (func.coalesce(CacheEntry.last_hit_at, 0).desc(), CacheEntry.id.desc()),
    "size": (CacheEntry.size_bytes.desc(), CacheEntry.id.desc()),
}


def _like(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _calls_text(calls: Any) -> str:
    """A stored tool-call answer as the dashboard shows it: ``name(arguments)`` per call."""
    if not isinstance(calls, list):
        return ""
    fns = [c.get("function") or {} for c in calls if isinstance(c, dict)]
    return "; ".join(f"{fn.get('name')}({fn.get('arguments')})" for fn in fns)


def entry_view(e: CacheEntry, preview: int = 300) -> dict[str, Any]:
    """An entry as the API shows it: the query and the start of the stored answer."""
    try:
        choice = (json.loads(e.response).get("choices") or [{}])[0]
        message = choice.get("message") or {}
        answer = message.get("content") or choice.get("text") or _calls_text(message.get("tool_calls"))
    except ValueError:
        answer = ""
    return {
        "id": e.id,
        "tenant": e.tenant,
        "model": e.model,
        "endpoint": e.endpoint,
        "scope": e.scope,
        "query": e.query_text,
        "answer": answer[:preview],
        "finish_reason": e.finish_reason,
        "hit_count": e.hit_count,
        "created_at": e.created_at,
        "last_hit_at": e.last_hit_at,
        "expires_at": e.expires_at,
        "size_bytes": e.size_bytes,
        "bad": bool(e.bad),
        "threshold": e.threshold,
    }


class AdminStore:
    """Takes the sessions of a ``Store`` (or of a read-only engine: `cachegw analyze`)."""

    def __init__(self, session: sessionmaker[Session]) -> None:
        self.session = session

    # Settings

    def get_setting(self, key: str) -> tuple[dict[str, Any], int]:
        """(value, version); ({}, 0) if never set."""
        with self.session() as s:
            row = s.get(Setting, key)
            return (json.loads(row.value), row.version) if row else ({}, 0)

    def setting_version(self, key: str) -> int:
        with self.session() as s:
            return int(s.scalar(select(Setting.version).where(Setting.key == key)) or 0)

    def put_setting(self, key: str, value: dict[str, Any], audit: dict[str, Any]) -> int:
        """Write the value and its audit event in one transaction; returns the new version."""
        with self.session.begin() as s:
            row = s.get(Setting, key)
            if row is None:
                row = Setting(key=key, value="{}", version=0, updated_at=0.0)
                s.add(row)
            row.value, row.version, row.updated_at = json.dumps(value), row.version + 1, time.time()
            s.add(_audit_event(**audit))
            log_changes(s, [Change(ChangeKind.SETTINGS)])  # other replicas refresh
            return row.version

    # Audit

    def audit(self, actor: str, action: str, target: str = "", old: Any = None, new: Any = None) -> None:
        with self.session.begin() as s:
            s.add(_audit_event(actor=actor, action=action, target=target, old=old, new=new))

    def audit_log(self, limit: int, offset: int = 0) -> list[dict[str, Any]]:
        with self.session() as s:
            rows = s.scalars(select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit).offset(offset))
            return [
                {
                    "id": a.id,
                    "ts": a.ts,
                    "actor": a.actor,
                    "action": a.action,
                    "target": a.target,
                    "old": json.loads(a.old) if a.old else None,
                    "new": json.loads(a.new) if a.new else None,
                }
                for a in rows
            ]

    def prune_audit_log(self, before: float) -> int:
        """Drop admin-API events older than ``before`` (``[admin] audit_log_days``)."""
        return delete_older(self.session, AuditEvent.ts, AuditEvent.id, before)

    def ping(self) -> None:
        """One trivial query: raises while the database does not answer (``/health/ready``)."""
        with self.session() as s:
            s.execute(select(literal(1)))

    # Feedback

    def add_feedback(self, row: dict[str, Any], audit: dict[str, Any]) -> int:
        with self.session.begin() as s:
            fb = Feedback(ts=time.time(), **row)
            s.add(fb)
            s.add(_audit_event(**audit))
            s.flush()
            return fb.id

    def feedback(self, limit: int = 50, since: float = 0.0) -> list[dict[str, Any]]:
        with self.session() as s:
            q = select(Feedback).where(Feedback.ts >= since).order_by(Feedback.id.desc()).limit(limit)
            return [{c: getattr(f, c) for c in Feedback.__table__.columns.keys()} for f in s.scalars(q)]

    def prune_feedback(self, before: float) -> int:
        """Drop bad-hit reports older than ``before`` (``[gateway] feedback_days``); what they did to
        entries (flags, learned thresholds) and their false-hit evidence stay."""
        return delete_older(self.session, Feedback.ts, Feedback.id, before)

    def flagged_request_ids(self, since: float) -> list[str]:
        with self.session() as s:
            q = select(Feedback.request_id).where(Feedback.ts >= since, Feedback.request_id.is_not(None))
            return [r for r in s.scalars(q) if r]

    # Entries

    def search_entries(
        self,
        query: str = "",
        tenant: str = "",
        model: str = "",
        scope: str = "",
        bad: bool | None = None,
        order: str = "hits",
        limit: int = 50,
        offset: int = 0,
    ) -> tuple[int, list[dict[str, Any]]]:
        """(total matching, one page), searching query text and answer by substring."""
        conds = []
        if query:
            conds.append(
                or_(CacheEntry.query_text.ilike(_like(query)), CacheEntry.response.ilike(_like(query)))
            )
        for col, value in ((CacheEntry.tenant, tenant), (CacheEntry.model, model), (CacheEntry.scope, scope)):
            if value:
                conds.append(col == value)
        if bad is not None:
            conds.append(CacheEntry.bad.is_(bad))
        with self.session() as s:
            total = int(s.scalar(select(func.count(CacheEntry.id)).where(*conds)) or 0)
            q = select(CacheEntry).where(*conds).order_by(*ENTRY_ORDER[order]).limit(limit).offset(offset)
            return total, [entry_view(e) for e in s.scalars(q)]

    def entry_ids(self, tenant: str = "", model: str = "", scope: str = "") -> list[int]:
        conds = [
            col == value
            for col, value in (
                (CacheEntry.tenant, tenant),
                (CacheEntry.model, model),
                (CacheEntry.scope, scope),
            )
            if value
        ]
        with self.session() as s:
            return list(s.scalars(select(CacheEntry.id).where(*conds)))

    def get_entry(self, entry_id: int) -> CacheEntry | None:
        with self.session() as s:
            return s.get(CacheEntry, entry_id)

    # Request log

    def find_request(self, request_id: str) -> RequestRecord | None:
        """By the gateway's request id (x-request-id) or the response body's id."""
        with self.session() as s:
            rec = s.scalars(
                select(RequestRow)
                .where(or_(RequestRow.id == request_id, RequestRow.response_id == request_id))
                .limit(1)
            ).first()
            return RequestRecord.from_row(rec) if rec else None

    def requests(
        self, since: float, until: float, tenant: str = "", model: str = "", limit: int = 2_000_000
    ) -> list[RequestRecord]:
        """Request-log records in [since, until), oldest first."""
        cols = [getattr(RequestRow, c) for c in COLUMNS]
        q = select(*cols).where(RequestRow.ts >= since, RequestRow.ts < until)
        if tenant:
            q = q.where(RequestRow.tenant == tenant)
        if model:
            q = q.where(RequestRow.model == model)
        with self.session() as s:
            return [RequestRecord.from_columns(r) for r in s.execute(q.order_by(RequestRow.ts).limit(limit))]


def _audit_event(actor: str, action: str, target: str = "", old: Any = None, new: Any = None) -> AuditEvent:
    return AuditEvent(
        ts=time.time(),
        actor=actor,
        action=action,
        target=target,
        old=None if old is None else json.dumps(old),
        new=None if new is None else json.dumps(new),
    )
