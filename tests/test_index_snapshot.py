"""HNSW snapshots: a restart reads the graph back, and whatever the file says, the database wins.

Each test builds an index from rows (what the gateway reads from its database), lets it write its
snapshot, changes the rows the way a later run or a crash would, and checks that the restored index
answers like a fresh build of the new rows.
"""

from __future__ import annotations

import logging
from pathlib import Path

import faiss
import numpy as np
import pytest

from cachegw.embeddings import snapshot
from cachegw.embeddings.index import ScopedIndex
from tests.test_index import DIM, brute, unit

THRESHOLD = 100  # scopes this large are HNSW


def index_at(directory: Path | None, **kw) -> ScopedIndex:
    return ScopedIndex(
        dim=DIM, hnsw_threshold=THRESHOLD, background=False, ef_search=512, snapshot_dir=directory, **kw
    )


def rows(ids: np.ndarray, vecs: np.ndarray, scope: str = "big") -> list[tuple[str, int, np.ndarray]]:
    return [(scope, int(i), v) for i, v in zip(ids, vecs, strict=True)]


def started(directory: Path | None, ids: np.ndarray, vecs: np.ndarray) -> ScopedIndex:
    idx = index_at(directory)
    idx.rebuild(iter(rows(ids, vecs)), progress=False)
    return idx


def assert_answers_like(idx: ScopedIndex, ids: np.ndarray, vecs: np.ndarray, rng: np.random.Generator):
    """Top-5 of the restored index equals brute force over exactly the live rows."""
    for q in unit(rng, 20):
        assert [i for i, _ in idx.search("big", q, k=5)] == brute(ids, vecs, q, 5)


def test_restart_reads_the_snapshot_instead_of_building(tmp_path: Path, monkeypatch) -> None:
    rng = np.random.default_rng(1)
    ids, vecs = np.arange(300, dtype=np.int64) * 7, unit(rng, 300)
    first = started(tmp_path, ids, vecs)
    assert first.scope_kind("big") == "hnsw"
    files = list(tmp_path.glob("*" + snapshot.SUFFIX))
    assert len(files) == 1 and files[0] == snapshot.path_for(tmp_path, "big")
    # the second start must not build anything: a build now would fail the test
    monkeypatch.setattr(ScopedIndex, "_build", lambda *a, **k: pytest.fail("built instead of restored"))
    second = started(tmp_path, ids, vecs)
    assert second.scope_kind("big") == "hnsw" and len(second) == 300
    assert_answers_like(second, ids, vecs, rng)
    assert second.stats()["tombstones"] == 0


def test_stale_snapshot_is_reconciled_with_the_database(tmp_path: Path, caplog) -> None:
    """Rows deleted and added after the snapshot (a kill -9 before the shutdown save)."""
    rng = np.random.default_rng(2)
    ids, vecs = np.arange(400, dtype=np.int64), unit(rng, 400)
    started(tmp_path, ids, vecs)  # writes the snapshot; no orderly shutdown follows
    gone = np.arange(0, 400, 10)  # 40 deleted: 10% stale
    keep = np.setdiff1d(ids, gone)
    new_ids, new_vecs = np.arange(1000, 1030, dtype=np.int64), unit(rng, 30)
    live_ids = np.concatenate([keep, new_ids])
    live_vecs = np.concatenate([vecs[keep], new_vecs])
    with caplog.at_level(logging.INFO, logger="cachegw.embeddings.index"):
        idx = started(tmp_path, live_ids, live_vecs)
    assert "30 added, 40 tombstoned" in caplog.text
    assert len(idx) == 390 and idx.stats()["tombstones"] == 40
    for i in gone[:5]:  # a deleted entry is never found, even searched with its own vector
        assert int(i) not in [j for j, _ in idx.search("big", vecs[i], k=10)]
    for j in range(5):  # an entry written after the snapshot is its own nearest neighbour
        assert idx.search("big", new_vecs[j])[0][0] == new_ids[j]
    assert_answers_like(idx, live_ids, live_vecs, rng)


@pytest.mark.parametrize("change", ["reused_id", "too_stale", "other_m", "corrupt", "truncated", "not_hnsw"])
def test_unusable_snapshot_means_a_fresh_build(tmp_path: Path, change: str) -> None:
    rng = np.random.default_rng(3)
    ids, vecs = np.arange(300, dtype=np.int64), unit(rng, 300)
    started(tmp_path, ids, vecs)
    path = snapshot.path_for(tmp_path, "big")
    if change == "reused_id":  # SQLite gave a deleted row's id to a new entry with another vector
        vecs = vecs.copy()
        vecs[299] = unit(rng, 1)[0]
    elif change == "too_stale":  # more than tombstone_ratio of the snapshot is out of date
        ids, vecs = ids[:200], vecs[:200]
    elif change == "other_m":
        other = index_at(tmp_path, hnsw_m=8)
        other.rebuild(iter(rows(ids, vecs)), progress=False)
    elif change == "corrupt":
        path.write_bytes(b"\x00garbage" * 100)
    elif change == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        flat = faiss.IndexIDMap(faiss.IndexFlatIP(DIM))
        flat.add_with_ids(vecs, ids)
        faiss.write_index(flat, str(path))
    built = []
    idx = index_at(tmp_path)
    original = idx._build
    idx._build = lambda *a, **k: built.append(1) or original(*a, **k)  # type: ignore[method-assign]
    idx.rebuild(iter(rows(ids, vecs)), progress=False)
    assert built == [1]  # built from the rows, not served from the file
    assert idx.stats()["tombstones"] == 0
    assert_answers_like(idx, ids, vecs, rng)
    # and the fresh build replaced the bad snapshot: the next start reads it
    again = index_at(tmp_path)
    again._build = lambda *a, **k: pytest.fail("built twice")  # type: ignore[method-assign]
    again.rebuild(iter(rows(ids, vecs)), progress=False)
    assert_answers_like(again, ids, vecs, rng)


def test_shutdown_save_covers_changes_made_while_serving(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    ids, vecs = np.arange(300, dtype=np.int64), unit(rng, 300)
    idx = started(tmp_path, ids, vecs)
    assert idx.save_snapshots() == 0  # nothing changed since the build wrote it
    extra = unit(rng, 5)
    idx.add("big", np.arange(500, 505), extra)
    idx.remove([0, 1, 2])
    assert idx.save_snapshots() == 1
    live_ids = np.concatenate([ids[3:], np.arange(500, 505)])
    live_vecs = np.concatenate([vecs[3:], extra])
    restarted = started(tmp_path, live_ids, live_vecs)
    assert len(restarted) == 302
    assert_answers_like(restarted, live_ids, live_vecs, rng)


def test_compaction_writes_a_snapshot_and_gone_scopes_lose_theirs(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    idx = index_at(tmp_path, tombstone_ratio=0.2)
    vecs = unit(rng, 150)
    idx.add("grow", np.arange(150), vecs)  # passes the threshold: switched to HNSW, then saved
    assert idx.scope_kind("grow") == "hnsw" and snapshot.path_for(tmp_path, "grow").is_file()
    idx.remove(range(140))  # compacted to flat (hysteresis: under half the threshold)
    assert idx.scope_kind("grow") == "flat"
    idx.save_snapshots()
    assert not snapshot.path_for(tmp_path, "grow").exists()
    (tmp_path / ("x" + snapshot.SUFFIX + ".tmp")).write_bytes(b"half a file from a crash")
    idx.rebuild(iter(rows(np.arange(140, 150), vecs[140:], "grow")), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_without_a_directory_nothing_is_written(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(6)
    idx = started(None, np.arange(200, dtype=np.int64), unit(rng, 200))
    assert idx.scope_kind("big") == "hnsw" and idx.save_snapshots() == 0
    assert list(tmp_path.iterdir()) == []


def test_config_defaults_are_the_index_defaults_and_bad_values_stop_the_start(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from cachegw.embeddings import index as ix
    from cachegw.gateway.config import load_settings

    got = load_settings(None).index
    assert (got.hnsw_threshold, got.hnsw_m, got.ef_construction, got.ef_search, got.tombstone_ratio) == (
        ix.HNSW_THRESHOLD,
        ix.HNSW_M,
        ix.EF_CONSTRUCTION,
        ix.EF_SEARCH,
        ix.TOMBSTONE_RATIO,
    )
    assert got.snapshots is True
    for bad in ("tombstone_ratio = 1.0", "hnsw_m = 0", "snapshot = true"):
        cfg = tmp_path / "bad.toml"
        cfg.write_text(f"[index]\n{bad}\n")
        with pytest.raises(ValidationError):
            load_settings(cfg)
