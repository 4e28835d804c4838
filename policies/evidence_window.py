"""False-hit evidence that ages: only the audits inside a window count (pure; ``error_control.py``
keeps one window per scope and per entry).

Traffic drifts and so does the model behind the gateway: an audit from last month says less about
today's hits than one from this morning. Old evidence is dropped rather than down-weighted: a window
of the last ``max_audits`` audits and/or of those younger than ``max_age_s``. Which audits count then
depends on their time and order only, never on their verdicts, so those that remain are still a
binomial sample of recent hits and the exact Clopper-Pearson bound stays valid. A decay (weights
0.99^age) would not give counts a binomial bound can take.
"""

from __future__ import annotations

from bisect import insort_right
from collections import deque
from dataclasses import dataclass

from cachegw.policies.error_bound import Evidence


@dataclass(frozen=True)
class Ageing:
    """``[cache] evidence_max_age_s`` and ``evidence_max_audits`` (0: no limit of that kind)."""

    max_age_s: float = 0.0
    max_audits: int = 0

    @property
    def on(self) -> bool:
        return self.max_age_s > 0 or self.max_audits > 0


class WindowedEvidence:
    """Per-cell counts of the audits inside the window; the rows themselves are kept only while
    ageing is on (to take them out again), oldest first by timestamp."""

    def __init__(self, ageing: Ageing) -> None:
        self.ageing = ageing
        self.evidence = Evidence()
        self._rows: deque[tuple[float, float, bool]] = deque()  # (ts, score, right)

    def add(self, ts: float, score: float, right: bool) -> None:
        self.evidence.add(score, right)
        if not self.ageing.on:
            return
        if self._rows and ts < self._rows[-1][0]:  # another replica's late row: keep the time order
            insort_right(self._rows, (ts, score, right), key=lambda r: r[0])
        else:
            self._rows.append((ts, score, right))
        while 0 < self.ageing.max_audits < len(self._rows):
            self._drop()

    def expire(self, now: float) -> bool:
        """Drop what is older than ``max_age_s``; True when anything was dropped."""
        if self.ageing.max_age_s <= 0:
            return False
        oldest = now - self.ageing.max_age_s
        dropped = False
        while self._rows and self._rows[0][0] < oldest:
            self._drop()
            dropped = True
        return dropped

    def _drop(self) -> None:
        _, score, right = self._rows.popleft()
        self.evidence.add(score, right, count=-1)
