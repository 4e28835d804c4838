"""Run-time settings over config.toml on real SQLite: validation, merging, audit, replicas, restarts."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachegw.gateway.config import load_settings
from cachegw.gateway.live_settings import LiveSettings, view
from cachegw.gateway.storage.admin_store import AdminStore
from cachegw.gateway.storage.store import Store
from cachegw.protocol.errors import ApiError


@pytest.fixture
def db(tmp_path: Path):
    store = Store(f"sqlite:///{tmp_path / 'live.db'}")
    yield store
    store.close()


def live(db: Store) -> LiveSettings:
    ls = LiveSettings(load_settings(), AdminStore(db.session))
    ls.load()
    return ls


def test_patch_changes_only_what_it_names_and_audits_old_and_new(db: Store) -> None:
    ls = live(db)
    before = view(ls.current)
    new = ls.patch({"thresholds": {"default": 0.5}, "eviction": {"policy": "lfu"}}, actor="ops")
    assert (new.cache.threshold, new.cache.eviction) == (0.5, "lfu")
    after = view(new)
    assert {k: v for k, v in after.items() if k not in ("thresholds", "eviction")} == {
        k: v for k, v in before.items() if k not in ("thresholds", "eviction")
    }
    assert ls.base.cache.threshold == before["thresholds"]["default"]  # config.toml's value is kept
    event = AdminStore(db.session).audit_log(1)[0]
    assert event["actor"] == "ops" and event["action"] == "settings.update"
    assert set(event["target"].split(",")) == {"thresholds.default", "eviction.policy"}
    assert event["new"]["thresholds.default"] == 0.5


def test_per_model_thresholds_merge_and_none_removes_one(db: Store) -> None:
    ls = live(db)
    ls.patch({"thresholds": {"models": {"m1": 0.8, "m2": 0.7}}}, actor="a")
    s = ls.patch({"thresholds": {"models": {"m1": None, "m3": 0.6}}}, actor="a")
    assert dict(s.cache.thresholds_by_model) == {"m2": 0.7, "m3": 0.6}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"thresholds": {"default": 1.5}}, "thresholds.default"),
        ({"ttl_seconds": 0}, "ttl_seconds"),
        ({"eviction": {"policy": "fifo"}}, "eviction.policy"),
        ({"unknown": 1}, "unknown"),
        ({"canonicalization": {"no_such_rule": True}}, "canonicalization.no_such_rule"),
        ({"verifier": {"enabled": "on"}}, "verifier.enabled"),
        ({"thresholds": {"default": "0.5"}}, "thresholds.default"),
        ({"max_ttl_seconds": "100"}, "max_ttl_seconds"),
        ({"cache": {"semantic": 0}}, "cache.semantic"),
    ],
)
def test_invalid_patch_is_a_400_naming_the_field_and_changes_nothing(db: Store, body, param) -> None:
    ls = live(db)
    before = view(ls.current)
    with pytest.raises(ApiError) as err:
        ls.patch(body, actor="a")
    assert err.value.status == 400 and (err.value.param or "").startswith(param)
    assert view(ls.current) == before and AdminStore(db.session).audit_log(5) == []


def test_not_an_object_is_a_400(db: Store) -> None:
    with pytest.raises(ApiError) as err:
        live(db).patch([1, 2], actor="a")
    assert err.value.status == 400


def test_another_replica_and_a_restart_see_the_change(db: Store) -> None:
    a, b = live(db), live(db)
    assert not b.changed_elsewhere()
    a.patch({"verifier": {"enabled": False}, "cache": {"semantic": False}}, actor="a")
    assert b.changed_elsewhere()
    s = b.load()
    assert (s.cache.verifier.enabled, s.cache.semantic) == (False, False)
    assert not b.changed_elsewhere()
    assert view(live(db).current) == view(a.current)  # a fresh start reads the same overrides
