"""Volatile values in forms no pattern lists, through the real gateway in front of the real engine (the
session's shared backend) with the real openai SDK: the gateway learns them from a tenant's requests,
the backend's prefix cache then reuses the whole system prompt, and two requests differing only in
such a value never share a cached answer. The request log and the admin API show what was learned."""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.test_admin import TOKEN, admin_settings
from tests.test_gateway import backend_url, chat, gateway  # noqa: F401

RULES = " ".join(f"Rule {i}: answer questions about orders {i} politely." for i in range(30))


def system(tier: str, account: int, salt: str) -> dict:
    """A support app's prompt: its per-request values come first, in forms no listed pattern has."""
    return {
        "role": "system",
        "content": f"Customer tier: {tier}\nKontonummer {account}\nShop {salt}.\n{RULES}",
    }


def logged(db: str, request_id: str) -> tuple[str, str] | None:
    """The request's (volatile, rules_fired) once the batched log writer has written it."""
    deadline = time.monotonic() + 10
    while True:
        with sqlite3.connect(db) as conn:
            q = "SELECT volatile, rules_fired FROM requests WHERE id = ?"
            row = conn.execute(q, (request_id,)).fetchone()
        if row or time.monotonic() > deadline:
            return row
        time.sleep(0.1)


def learned_with(url: str, salt: str) -> list[dict]:
    """The learned templates (admin API) of the prompts carrying ``salt``."""
    r = httpx.get(f"{url}/admin/api/volatile", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
    r.raise_for_status()
    templates = [t for tenant in r.json()["data"] for t in tenant["templates"]]
    return [t for t in templates if any(salt in s["after"] for s in t["spans"])]


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


@pytest.fixture(scope="module")
def gw(backend_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:  # noqa: F811
    data_dir = tmp_path_factory.mktemp("volatile")
    with gateway(admin_settings(data_dir, backend_url)) as url:
        yield url, str(data_dir / "cachegw.db")


# The answers' text does not matter here: max_tokens=2 keeps each miss to its prefill.


def test_unlisted_volatile_values_are_learned_and_the_prefix_is_reused(gw: tuple[str, str]) -> None:
    url, _ = gw
    salt = uuid.uuid4().hex[:8]  # no other test warmed this prompt
    tiers = ["GOLD", "SILVER", "BRONZE", "PLATINUM", "DIAMOND"]
    usage = []
    for i, tier in enumerate(tiers):
        _, h, u = chat(
            url, [system(tier, 4711 + i, salt), {"role": "user", "content": f"Order {i}?"}], max_tokens=2
        )
        assert h["x-cache"] == "miss"
        usage.append(u)
    # before learning, the first value (the first line) breaks the prefix: almost nothing is reused
    assert cached(usage[1]) < 32
    # the third request taught the template and was sent with it; from the fourth on, the whole
    # system prompt is one cached prefix
    system_tokens = usage[0]["prompt_tokens"] - 40
    assert cached(usage[3]) >= system_tokens and cached(usage[4]) >= system_tokens


def test_requests_differing_only_in_a_learned_value_never_share_an_answer(gw: tuple[str, str]) -> None:
    url, db = gw
    salt = uuid.uuid4().hex[:8]
    question = {"role": "user", "content": "What is my discount?"}
    for i, tier in enumerate(["GOLD", "SILVER", "BRONZE"]):  # learned from these
        chat(url, [system(tier, 100 + i, salt), {"role": "user", "content": f"Hello {i}"}], max_tokens=2)
    _, first, _ = chat(url, [system("GOLD", 100, salt), question])
    _, other, _ = chat(url, [system("SILVER", 100, salt), question])  # only the tier differs
    _, again, _ = chat(url, [system("GOLD", 100, salt), question])
    assert first["x-cache"] == "miss" and other["x-cache"] == "miss"
    # not even a candidate: the GOLD answer is in another scope, never compared by meaning
    assert other["x-cache-reason"] == "no-candidate"
    assert again["x-cache"] == "exact-hit"  # the cache still works for a true repeat
    row = logged(db, other["x-request-id"])
    assert row is not None and "volatile_to_tail" in row[1]
    assert "[Customer tier:]" in row[0] and "[Kontonummer]" in row[0] and row[0].startswith("learned:")


def test_the_admin_api_lists_learned_templates_per_tenant(gw: tuple[str, str]) -> None:
    url, _ = gw
    salt = uuid.uuid4().hex[:8]
    for i, tier in enumerate(["GOLD", "SILVER", "BRONZE"]):
        chat(
            url,
            [system(tier, 7 + i, salt), {"role": "user", "content": "Hi"}],
            key="tenant-admin",
            max_tokens=2,
        )
    assert httpx.get(f"{url}/admin/api/volatile", timeout=30).status_code == 401
    mine = learned_with(url, salt)
    assert len(mine) == 1 and [s["label"] for s in mine[0]["spans"]] == ["Customer tier:", "Kontonummer"]
    assert mine[0]["matches"] >= 1


def test_no_store_requests_teach_nothing(gw: tuple[str, str]) -> None:
    """A no-store request keeps nothing, not even its system prompt in the learner's memory."""
    url, _ = gw
    salt = uuid.uuid4().hex[:8]
    for i, tier in enumerate(["GOLD", "SILVER", "BRONZE", "PLATINUM"]):
        messages = [system(tier, 50 + i, salt), {"role": "user", "content": "Hi"}]
        _, h, _ = chat(
            url, messages, key="tenant-private", extra_headers={"cache-control": "no-store"}, max_tokens=2
        )
        assert h["x-cache"] == "bypass"
    assert learned_with(url, salt) == []


def test_a_request_log_from_before_the_volatile_column_gets_it(tmp_path) -> None:
    from cachegw.gateway.storage.recorder import SqlRequestLog
    from cachegw.gateway.storage.request_record import RequestRecord
    from cachegw.gateway.storage.store import Store
    from tests.test_recorder import row as log_row

    url = f"sqlite:///{tmp_path / 'old.db'}"
    Store(url).close()
    with sqlite3.connect(tmp_path / "old.db") as conn:  # as the schema was before this column
        conn.execute("DROP TABLE alembic_version")  # and before Alembic
        conn.execute('ALTER TABLE requests DROP COLUMN "volatile"')
    store = Store(url)
    row = RequestRecord.from_dict(log_row(1) | {"volatile": "learned:abc[Customer tier:]"})
    SqlRequestLog(store.session).log_requests([row])
    store.close()
    with sqlite3.connect(tmp_path / "old.db") as conn:
        assert conn.execute("SELECT volatile FROM requests").fetchall() == [("learned:abc[Customer tier:]",)]
