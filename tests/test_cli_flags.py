"""`cachegw --version`, and the log flags of serve/backend: levels, and JSON lines a log shipper reads."""

from __future__ import annotations

import json
import logging
import sys
from importlib import metadata

import pytest

from cachegw.configtools.logs import REQUEST_ID, JsonFormatter, env_choice
from cachegw.gateway.cli import build_parser, main


def test_version_is_the_installed_distribution(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"cachegw {metadata.version('cachegw')}"


def test_log_flags_of_serve_and_backend(monkeypatch) -> None:
    monkeypatch.delenv("CACHEGW_LOG_LEVEL", raising=False)
    monkeypatch.delenv("CACHEGW_LOG_FORMAT", raising=False)
    args = build_parser().parse_args(["serve", "--log-level", "debug", "--log-format", "JSON"])
    assert (args.log_level, args.log_format) == ("DEBUG", "json")
    args = build_parser().parse_args(["backend"])
    assert (args.log_level, args.log_format) == ("INFO", "text")
    monkeypatch.setenv("CACHEGW_LOG_FORMAT", "json")  # how the gateway hands its choice to its engine
    assert build_parser().parse_args(["backend"]).log_format == "json"


def test_a_bad_log_flag_is_refused(monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["serve", "--log-level", "LOUD"])
    assert done.value.code == 2 and "LOUD" in capsys.readouterr().err
    monkeypatch.setenv("CACHEGW_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="CACHEGW_LOG_LEVEL='LOUD'"):
        env_choice("CACHEGW_LOG_LEVEL", ("DEBUG", "INFO"), "INFO")
    assert main(["serve"]) == 2
    assert "CACHEGW_LOG_LEVEL" in capsys.readouterr().err


def _record(message: str, **extra: object) -> logging.LogRecord:
    args = ("x",) if "%s" in message else ()
    record = logging.LogRecord("cachegw.gateway", logging.WARNING, __file__, 1, message, args, None)
    record.__dict__.update(extra)
    return record


def test_json_lines() -> None:
    line = json.loads(JsonFormatter().format(_record("backend %s down")))
    assert set(line) == {"ts", "level", "logger", "message"}
    assert (line["level"], line["logger"]) == ("WARNING", "cachegw.gateway")
    assert line["message"] == "backend x down"
    assert line["ts"].endswith("+00:00")
    token = REQUEST_ID.set("req-1")  # inside a request's flow
    try:
        assert json.loads(JsonFormatter().format(_record("m")))["request_id"] == "req-1"
        assert json.loads(JsonFormatter().format(_record("m", request_id="req-2")))["request_id"] == "req-2"
    finally:
        REQUEST_ID.reset(token)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = _record("failed")
        record.exc_info = sys.exc_info()
    assert "RuntimeError: boom" in json.loads(JsonFormatter().format(record))["exc_info"]
