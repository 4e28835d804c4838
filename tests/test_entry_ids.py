"""``x-cache-entry`` is opaque and per tenant (issue 13): the real gateway in front of the real engine.

It was the database's global row id, so a tenant could count the entries other tenants stored
between two of its own hits. Now it is an AES block of the entry id and a tenant-bound tag.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator

import httpx
import pytest

from cachegw.gateway.storage.entry_ids import EntryIds
from tests.test_admin import admin_settings, api
from tests.test_gateway import ask, backend_url, chat, gateway  # noqa: F401


def test_ids_are_unordered_per_tenant_and_read_back_only_for_their_tenant():
    ids = EntryIds("secret")
    shown = [ids.encode("tenant-a", n) for n in range(1, 41)]
    assert shown != sorted(shown)  # consecutive entries do not sort in order
    # the bytes behind an id are not the entry id either (the first 8 would be, unencrypted)
    raw = [struct.unpack(">Q", base64.urlsafe_b64decode(s[3:] + "==")[:8])[0] for s in shown]
    assert raw != list(range(1, 41))
    assert [ids.decode("tenant-a", s) for s in shown] == list(range(1, 41))
    assert {ids.decode("tenant-b", s) for s in shown} == {None}
    assert ids.encode("tenant-b", 7) != shown[6] and ids.decode_any(ids.encode("tenant-b", 7)) == 7
    assert EntryIds("another-token").decode("tenant-a", shown[0]) is None  # keyed by the admin token


@pytest.fixture(scope="module")
def shared(backend_url, tmp_path_factory) -> Iterator[str]:  # noqa: F811
    """Tenants share one cache here, so two tenants can hit the very same entry."""
    s = admin_settings(tmp_path_factory.mktemp("entry-ids"), backend_url)
    s = s.model_copy(update={"tenants": s.tenants.model_copy(update={"shared_cache": True})})
    with gateway(s) as url:
        yield url


def feedback(url: str, key: str, entry: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/cache/feedback",
        headers={"authorization": f"Bearer {key}"},
        json={"entry_id": entry, "verdict": "bad"},
        timeout=60,
    )


def test_one_entry_shows_each_tenant_its_own_id_and_feedback_takes_only_ones_own(shared):
    q1, q2 = ask("Name a chemical element."), ask("Name a country in Africa.")
    chat(shared, q1, key="tenant-a")
    chat(shared, q2, key="tenant-a")
    _, a1, _ = chat(shared, q1, key="tenant-a")
    _, a2, _ = chat(shared, q2, key="tenant-a")
    _, b1, _ = chat(shared, q1, key="tenant-b")
    assert (a1["x-cache"], a2["x-cache"], b1["x-cache"]) == ("exact-hit",) * 3
    ea1, ea2, eb1 = a1["x-cache-entry"], a2["x-cache-entry"], b1["x-cache-entry"]
    assert all(e.startswith("ce-") and not e[3:].isdigit() for e in (ea1, ea2, eb1))
    assert ea1 != eb1  # one entry, a different id per tenant
    # the admin API reads any tenant's id: both name the same entry
    e_a, e_b = api(shared, "GET", f"/entries/{ea1}").json(), api(shared, "GET", f"/entries/{eb1}").json()
    assert e_a["id"] == e_b["id"] and e_a["query"] == "Name a chemical element."
    assert api(shared, "GET", f"/entries/{e_a['id']}").json()["query"] == e_a["query"]  # integer too
    # tenant B cannot use A's id (nor A B's): 404, the same answer as for an id that never existed
    for key, other in (("tenant-b", ea1), ("tenant-a", eb1), ("tenant-b", ea2)):
        r = feedback(shared, key, other)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert r.json()["error"]["message"] == f"No cache entry '{other}'."  # nothing more
    assert chat(shared, q1, key="tenant-a")[1]["x-cache"] == "exact-hit"  # nothing was flagged
    # A's own id flags the entry it names, and only that one
    r = feedback(shared, "tenant-a", ea1)
    assert r.status_code == 200 and r.json()["entry_id"] == ea1 and "id" not in r.json()
    assert r.json()["entry_query"] == "Name a chemical element."
    assert chat(shared, q1, key="tenant-b")[1]["x-cache"] == "miss"
    assert chat(shared, q2, key="tenant-a")[1]["x-cache"] == "exact-hit"
    assert api(shared, "GET", f"/entries/{ea1}").json()["bad"] is True


def test_admin_deletes_by_the_opaque_id(shared):
    q = ask("Name a kind of bird.")
    chat(shared, q, key="tenant-c")
    _, h, _ = chat(shared, q, key="tenant-c")
    assert h["x-cache"] == "exact-hit"
    assert api(shared, "DELETE", f"/entries/{h['x-cache-entry']}").json() == {"deleted": 1}
    assert api(shared, "DELETE", f"/entries/{h['x-cache-entry']}").status_code == 404
    assert api(shared, "GET", "/entries/ce-not-an-id").status_code == 400
    assert api(shared, "GET", "/entries/ce-not-an-id", token=None).status_code == 401
