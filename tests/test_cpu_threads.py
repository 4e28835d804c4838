"""Where the engine's threads run (backend/executor/cpu_threads.py) and how `cachegw serve` splits the cores
between itself and its built-in engine (gateway/supervisor.split_cores): pure decisions, no torch."""

from __future__ import annotations

import pytest

from cachegw.backend.config import load_engine_config
from cachegw.backend.executor.cpu_threads import plan
from cachegw.configtools.cpus import format_cpus, parse_cpus
from cachegw.gateway.upstream.supervisor import CoreSplit, split_cores

ALL = frozenset({0, 1, 2, 3})


@pytest.mark.parametrize(
    ("text", "cpus"), [("1", {1}), ("0-3", {0, 1, 2, 3}), ("0,2-3", {0, 2, 3}), (" 5 , 7 ", {5, 7})]
)
def test_cpu_lists_read_and_write_back(text: str, cpus: set[int]) -> None:
    assert parse_cpus(text) == cpus
    assert parse_cpus(format_cpus(cpus)) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "1-", "-1", "1,,2"])
def test_a_bad_cpu_list_is_an_error(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpus(text)


def test_format_uses_ranges() -> None:
    assert format_cpus({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


def test_one_thread_per_core_and_passive_waiting_with_several() -> None:
    p = plan(load_engine_config(None), ALL)
    assert (p.cpus, p.threads, p.wait_policy) == (ALL, 4, "PASSIVE")
    lone = plan(load_engine_config(None, cpus="3"), ALL)
    assert (lone.cpus, lone.threads, lone.wait_policy) == ({3}, 1, "")  # one thread never waits on another
    assert plan(load_engine_config(None, threads=2, omp_wait_policy="runtime"), ALL).wait_policy == ""
    assert plan(load_engine_config(None, omp_wait_policy="active"), ALL).wait_policy == "ACTIVE"


def test_cpus_outside_what_the_process_may_use_are_dropped_or_refused() -> None:
    assert plan(load_engine_config(None, cpus="2-9"), ALL).cpus == {2, 3}
    with pytest.raises(ValueError, match="names none"):
        plan(load_engine_config(None, cpus="8-9"), ALL)


@pytest.mark.parametrize(("field", "value"), [("cpus", "x"), ("threads", -1), ("omp_wait_policy", "spin")])
def test_bad_engine_settings_stop_the_start(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        load_engine_config(None, **{field: value})


def test_serve_keeps_the_first_core_and_gives_the_engine_the_rest() -> None:
    assert split_cores("auto", ALL) == CoreSplit(frozenset({0}), frozenset({1, 2, 3}))
    assert split_cores("auto", frozenset({4, 6})) == CoreSplit(frozenset({4}), frozenset({6}))
    assert split_cores("auto", frozenset({2})) == CoreSplit(None, None)  # one core: nothing to split
    assert split_cores("all", ALL) == CoreSplit(None, None)
    assert split_cores("2-3", ALL) == CoreSplit(frozenset({0, 1}), frozenset({2, 3}))
    assert split_cores("0-3", ALL) == CoreSplit(None, ALL)  # nothing left: the gateway keeps every core
    with pytest.raises(ValueError, match="names none"):
        split_cores("7", ALL)


def test_bad_core_setting_of_the_gateway_stops_the_start(tmp_path) -> None:
    from cachegw.gateway.config import load_settings

    config = tmp_path / "c.toml"
    config.write_text('[engine]\ncpus = "one"\n')
    with pytest.raises(ValueError, match="cpus"):
        load_settings(config, data_dir=str(tmp_path))
    config.write_text('[gateway]\nbuiltin_backend_cpus = "1"\n')  # the old key names its new place
    with pytest.raises(ValueError, match=r"builtin_backend_cpus is now \[engine\] cpus"):
        load_settings(config, data_dir=str(tmp_path))
