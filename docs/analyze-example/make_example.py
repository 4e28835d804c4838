"""Regenerate the example in this folder from a synthetic request log (no gateway involved).

.venv/bin/python docs/analyze-example/make_example.py

Writes ~600 made-up requests (3 models, 4 tenants, 5 system prompts, Zipf-distributed repeated
questions, a few hits flagged bad) into a temporary SQLite database with the gateway's own tables, then
runs `cachegw analyze --format md` on it into this folder. Seeded: the output is the same each run.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from cachegw.gateway.offline.analyze import main_analyze  # noqa: E402
from cachegw.gateway.request.tenants import key_hash  # noqa: E402
from cachegw.gateway.storage.store import Store  # noqa: E402
from cachegw.gateway.storage.tables import Feedback  # noqa: E402

START = datetime(2025, 3, 3, tzinfo=UTC).timestamp()
MODELS = {"gpt-4o-mini": 0.5, "llama-3.1-8b": 0.35, "qwen2.5-32b": 0.15}
TENANTS = [key_hash(f"sk-example-{name}") for name in ("support", "search", "docs-bot", "batch")]
SYSTEMS = {"3f9a1c2e": 0.82, "a41be077": 0.64, "c5d20f19": 0.35, "e7e1b3aa": 0.12, None: 0.0}
RULES = {"trailing_whitespace": 0.3, "volatile_to_tail": 0.25, "json_key_order": 0.1, "unicode_nfc": 0.05}
QUESTIONS = [
    "How do I reset my password?",
    "How can I cancel my subscription?",
    "Can I export invoices as CSV?",
    "How do I change the billing email?",
    "How do I turn on two-factor login?",
    "What are the API rate limits?",
    "How do I delete my account?",
    "Which file types can I upload?",
    "What is your refund policy?",
    "How do I add a team member?",
    "How often are webhooks retried?",
    "Do you support SSO with Okta?",
    "Where can I find my API key?",
    "Why was my card declined?",
    "How do I change my plan?",
    "Is there a free trial?",
    "How do I rotate an API key?",
    "Can I pay by bank transfer?",
    "How do I download my data?",
    "What regions do you host in?",
]


def make_rows(rng: random.Random, n: int) -> list[dict]:
    """One day of traffic, busier in office hours; repeats of popular questions become hits."""
    seen: set[tuple[str, int]] = set()
    rows = []
    for i in range(n):
        hour = rng.choices(range(24), weights=[1 + 4 * (8 <= h <= 18) for h in range(24)])[0]
        ts = START + 3600 * hour + rng.uniform(0, 3600)
        model = rng.choices(list(MODELS), weights=list(MODELS.values()))[0]
        tenant = rng.choice(TENANTS)
        q = rng.choices(range(60), weights=[1 / (k + 2) for k in range(60)])[0]
        system = rng.choice(list(SYSTEMS))
        rules = [r for r, p in RULES.items() if rng.random() < p]
        result, sim = "bypass", None
        if rng.random() > 0.08:
            if (tenant, q) in seen and rng.random() < 0.5:
                result = "exact-hit"
            else:
                sim = round(
                    min(0.999, rng.betavariate(9, 2.2) if (tenant, q) in seen else rng.betavariate(6, 3)), 4
                )
                result = "semantic-hit" if sim >= 0.88 and rng.random() < 0.9 else "miss"
        seen.add((tenant, q))
        prompt = rng.randint(300, 4000)
        ratio = SYSTEMS[system] + (0.12 if "volatile_to_tail" in rules else 0.0)
        backend = result in ("miss", "bypass")
        rows.append(
            {
                "id": f"req-{i:05d}",
                "ts": ts,
                "tenant": tenant,
                "model": model,
                "endpoint": "chat",
                "stream": rng.random() < 0.3,
                "cache_result": result,
                "similarity": sim,
                "threshold": 0.88 if sim is not None else None,
                "entry_id": i if result.endswith("hit") else None,
                "rules_fired": ",".join(rules),
                "embed_ms": rng.uniform(2, 6) if result != "bypass" else None,
                "lookup_ms": rng.uniform(0.3, 2),
                "backend_ms": rng.lognormvariate(6.5, 0.5) if backend else None,
                "total_ms": rng.lognormvariate(6.5, 0.5) + 8 if backend else rng.uniform(4, 15),
                "prompt_tokens": prompt,
                "completion_tokens": rng.randint(40, 600),
                "cached_tokens": int(prompt * min(0.95, ratio * rng.uniform(0.7, 1.1))) if backend else None,
                "status": 200,
                "error": None,
                "response_id": f"chatcmpl-{i}",
                "stored_entry_id": None,
                "scope": _hash(tenant, model, system),
                "system_hash": system,
                "query_hash": _hash(q),
                "query": _question(q),
            }
        )
    return sorted(rows, key=lambda r: r["ts"])


def _hash(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _question(q: int) -> str:
    """60 distinct questions: 20 base ones, then reworded for a product."""
    base = QUESTIONS[q % len(QUESTIONS)]
    return base if q < len(QUESTIONS) else f"{base[:-1]} in the {['mobile app', 'web console'][q // 40]}?"


def flag_some(rng: random.Random, rows: list[dict]) -> list[Feedback]:
    """A few low-similarity semantic hits reported bad, as users would."""
    hits = [r for r in rows if r["cache_result"] == "semantic-hit" and r["similarity"] < 0.91]
    return [
        Feedback(
            ts=r["ts"] + 120,
            request_id=r["id"],
            entry_id=r["entry_id"],
            tenant=r["tenant"],
            actor="user",
            verdict="bad",
            cache_result=r["cache_result"],
            similarity=r["similarity"],
        )
        for r in hits
        if rng.random() < 0.4
    ]


def main() -> int:
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        store = Store("sqlite:///cachegw.db")
        rows = make_rows(rng, 600)
        store.log_requests(rows)
        with store.session.begin() as s:
            s.add_all(flag_some(rng, rows))
        store.close()
        argv = ["--db", "sqlite:///cachegw.db", "--since", "2025-03-03", "--until", "2025-03-04"]
        code = main_analyze([*argv, "--out", str(HERE), "--format", "md"])
    (HERE / "summary.json").unlink(missing_ok=True)  # the docs keep the page and the charts only
    page = HERE / "report.md"
    note = "> Synthetic data: made up by `make_example.py` in this folder, not recorded from a gateway.\n\n"
    page.write_text(note + page.read_text())
    return code


if __name__ == "__main__":
    sys.exit(main())
