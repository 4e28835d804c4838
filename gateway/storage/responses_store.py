"""SQL of the Responses API's stored responses: one tenant's Responses, kept for ``previous_response_id``
and for ``GET``/``DELETE /v1/responses/{id}``, pruned by age.

Each row keeps the Response and the input items of the whole conversation before it, so going on from
a response is one read however long the chain (the next request's history is those items, then this
response's output, then its own input).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from cachegw.gateway.storage.tables import StoredResponse


@dataclass(frozen=True)
class SavedResponse:
    response: dict[str, Any]
    items: list[dict[str, Any]]  # the conversation's input items before this response's output


class ResponsesStore:
    def __init__(self, session: sessionmaker[Session], clock: Callable[[], float] = time.time) -> None:
        self.session, self.clock = session, clock

    def save(self, tenant: str, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        row = StoredResponse(
            id=response["id"],
            tenant=tenant,
            created_at=self.clock(),
            response=json.dumps(response, ensure_ascii=False),
            items=json.dumps(items, ensure_ascii=False),
        )
        with self.session.begin() as s:
            s.merge(row)

    def get(self, tenant: str, response_id: str) -> SavedResponse | None:
        """The tenant's response of that id; None for another tenant's (its ids are not to be probed)."""
        with self.session() as s:
            row = s.scalar(
                select(StoredResponse).where(
                    StoredResponse.id == response_id, StoredResponse.tenant == tenant
                )
            )
            return None if row is None else SavedResponse(json.loads(row.response), json.loads(row.items))

    def delete(self, tenant: str, response_id: str) -> bool:
        with self.session.begin() as s:
            gone = s.execute(
                delete(StoredResponse).where(
                    StoredResponse.id == response_id, StoredResponse.tenant == tenant
                )
            )
            return bool(getattr(gone, "rowcount", 0))

    def prune(self, older_than_s: float) -> int:
        """Drop responses stored more than ``older_than_s`` ago; how many went."""
        with self.session.begin() as s:
            gone = s.execute(
                delete(StoredResponse).where(StoredResponse.created_at < self.clock() - older_than_s)
            )
            return int(getattr(gone, "rowcount", 0) or 0)
