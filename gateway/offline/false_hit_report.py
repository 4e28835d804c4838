"""`cachegw analyze`'s section on the bounded false-hit rate: read from the evidence table, printed."""

from __future__ import annotations

import time
from typing import Any

from cachegw.gateway.config import Settings


def read_false_hits(url: str, settings: Settings) -> dict[str, Any]:
    """The bounded false-hit rate per scope from the evidence table (what the gateway's ageing window
    holds now: the bound's own view, not the --since window); empty for a database from before it."""
    from sqlalchemy import inspect
    from sqlalchemy.orm import sessionmaker

    from cachegw.gateway.cache.error_control import evidence_of, rates
    from cachegw.gateway.storage.evidence_store import EvidenceStore
    from cachegw.gateway.storage.request_log import open_database

    engine, _ = open_database(url)
    try:
        if "hit_audits" not in inspect(engine).get_table_names():
            return {}
        store = EvidenceStore(sessionmaker(engine))
        return {
            **rates(
                evidence_of(store.since(0.0), settings.cache.error_bound.ageing, time.time()), settings.cache
            ),
            "audit_backend_tokens": store.backend_tokens(),
        }
    finally:
        engine.dispose()


def print_false_hits(view: dict[str, Any]) -> None:
    """One line per scope: target, line, the estimate with its interval, audits."""
    if not view.get("by_scope"):
        return
    print(f"False-hit rate of semantic hits (audits, {view['confidence']:.0%} Clopper-Pearson interval):")
    for scope, v in [*view["by_scope"].items(), ("overall", view["overall"])]:
        est = (
            "no hits audited"
            if v["estimate"] is None
            else f"{v['estimate']:.2%} [{v['interval'][0]:.2%}, {v['interval'][1]:.2%}]"
        )
        target = f"target {v['target']:.1%}" if v["target"] else "no target"
        line = (
            ""
            if scope == "overall"
            else (f", line {v['line']:.2f}" if v["line"] is not None else ", no line: no semantic hits")
        )
        print(f"  {scope}: {est}, {target}{line}, {v['audits']} audits at the line of {v['evidence']}")
    print(f"  audit cost: {view.get('audit_backend_tokens', 0):,} backend tokens")
