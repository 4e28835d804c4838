"""Tenants from request headers: open and keys modes, shared cache, admin names, no raw key kept."""

from __future__ import annotations

import pytest

from cachegw.gateway.config import TenantsConfig
from cachegw.gateway.request.tenants import ANONYMOUS, Tenants, key_hash
from cachegw.protocol.errors import ApiError

KEYS = {"alice": "sk-alice-1", "bob": "sk-bob-2"}


def tenants(mode: str = "open", shared: bool = False, keys: dict[str, str] | None = None) -> Tenants:
    return Tenants(TenantsConfig(mode=mode, shared_cache=shared, keys=keys or {}))


@pytest.mark.parametrize(
    "auth,api_key,key",
    [
        ("Bearer sk-x", None, "sk-x"),
        ("bearer   sk-x  ", None, "sk-x"),
        (None, "sk-x", "sk-x"),
        ("", " sk-x ", "sk-x"),
        ("Basic dXNlcjpwdw==", None, "Basic dXNlcjpwdw=="),
    ],
)
def test_open_mode_every_key_is_its_own_tenant(auth, api_key, key) -> None:
    t = tenants().resolve(auth, api_key)
    assert t.id == key_hash(key) == t.name == t.cache_key
    assert key not in (t.id, t.name, t.cache_key)


def test_open_mode_without_key_is_anonymous_and_shared_cache_is_star() -> None:
    assert tenants().resolve(None).id == ANONYMOUS
    assert tenants().resolve("Bearer a").id != tenants().resolve("Bearer b").id
    shared = tenants(shared=True).resolve("Bearer a")
    assert shared.cache_key == "*" and shared.id == key_hash("a")


def test_keys_mode_names_configured_keys_and_refuses_others() -> None:
    t = tenants("keys", keys=KEYS)
    alice = t.from_headers({"authorization": "Bearer sk-alice-1"})
    assert (alice.name, alice.id) == ("alice", key_hash("sk-alice-1"))
    assert t.from_headers({"api-key": "sk-bob-2"}).name == "bob"
    assert t.from_headers({"x-api-key": "sk-bob-2"}).name == "bob"  # Anthropic's header
    for auth, message in [("Bearer nope", "Incorrect API key"), (None, "didn't provide")]:
        with pytest.raises(ApiError) as err:
            t.resolve(auth)
        assert err.value.status == 401 and message in str(err.value)


def test_admin_names_map_to_ids_and_back() -> None:
    t = tenants("keys", keys=KEYS)
    bob = key_hash("sk-bob-2")
    assert t.id_of("bob") == bob and t.name_of(bob) == "bob"
    assert t.id_of("deadbeef") == "deadbeef" and t.name_of("deadbeef") == "deadbeef"
    assert t.cache_key_of("bob") == bob
    assert tenants("keys", shared=True, keys=KEYS).cache_key_of("bob") == "*"


def test_two_tenants_cannot_share_a_key() -> None:
    with pytest.raises(ValueError, match="share one API key"):
        TenantsConfig(mode="keys", shared_cache=False, keys={"a": "k", "b": "k"})
