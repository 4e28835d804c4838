"""CPU lists ("1", "0-3", "0,2-3"), as Linux writes them: the engine's and the gateway's cores."""

from __future__ import annotations


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as a set of core numbers; ValueError for anything else."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, dash, hi = part.partition("-")
        hi = hi if dash else lo
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise ValueError(f"{text!r} is not a CPU list such as 1, 0-3 or 0,2-3")
        cpus.update(range(int(lo), int(hi) + 1))
    return frozenset(cpus)


def format_cpus(cpus: frozenset[int] | set[int]) -> str:
    """The shortest CPU list for a set of cores ({0, 1, 2, 5} -> "0-2,5")."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
