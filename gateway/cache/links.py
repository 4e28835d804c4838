"""Near misses that become hits: pairs of entries an audit found to share an answer.

A near miss is a request whose nearest candidate was refused only by the verifier or the error-bound
line. Its audit compares the client's fresh answer with the candidate's stored one (no backend call);
when they are the same answer (the audits' own verdict, ``Auditor.same_answer``), the evidence row
names both the candidate (``entry_id``) and the near-miss request's own stored entry
(``linked_entry_id``): the two are linked. A later request whose candidates include both ends of a
link, each refused only softly, is served the nearer one (``SemanticTier``, reason ``link``): it sits
between two requests that are known to share one answer.

Links are evidence like any audit: they live in the ``hit_audits`` rows, so every replica on the
database reads them through the change log as it reads the rest (``ThresholdProvider.apply``), and a
later wrong verdict on either entry (an audit of a hit it served, a wrong near miss, a bad-hit report)
removes every link of that entry. Both ends are always in one scope (tenant, model, context): a near
miss's candidate is one, and the tier checks both entries' scope again before serving.
"""

from __future__ import annotations

from collections.abc import Iterable

from cachegw.configtools.lru import Lru
from cachegw.gateway.storage.evidence_store import EvidenceRow

LINKS = 100_000  # links kept at most per replica (oldest dropped: the tier then refuses as before)


class EntryLinks:
    def __init__(self, limit: int = LINKS) -> None:
        # (low id, high id), the least recently linked evicted first (and unlinked)
        self._pairs: Lru[tuple[int, int], None] = Lru(limit, lambda pair, _: self._unlink(*pair))
        self._of: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._pairs)

    def apply(self, rows: Iterable[EvidenceRow]) -> None:
        """Rows in the order written: a right near miss links, any wrong verdict unlinks its entry."""
        for r in rows:
            if r.entry_id is None:
                continue
            if not r.right:
                self.drop(r.entry_id)
            elif r.source == "near-miss" and r.linked_entry_id not in (None, r.entry_id):
                self.link(r.entry_id, r.linked_entry_id)

    def link(self, a: int, b: int) -> None:
        self._of.setdefault(a, set()).add(b)
        self._of.setdefault(b, set()).add(a)
        self._pairs[min(a, b), max(a, b)] = None  # past the limit: the least recently linked pair goes

    def drop(self, entry_id: int) -> None:
        for other in list(self._of.get(entry_id, ())):
            self._pairs.pop((min(entry_id, other), max(entry_id, other)), None)
            self._unlink(entry_id, other)

    def _unlink(self, a: int, b: int) -> None:
        for x, y in ((a, b), (b, a)):
            linked = self._of.get(x)
            if linked is not None:
                linked.discard(y)
                if not linked:
                    del self._of[x]

    def linked(self, a: int, b: int) -> bool:
        return b in self._of.get(a, ())

    def clear(self) -> None:
        self._pairs.clear()
        self._of.clear()
