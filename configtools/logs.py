"""The log of `cachegw serve` and `cachegw backend`: one root handler, as text or as JSON lines.

Here, beside the config, because both commands set it up and the gateway's request code marks the
request in flight (``REQUEST_ID``); configtools imports nothing of ours, so every package may use it.

Set up once by the command line (``--log-level``, ``--log-format``); uvicorn's own loggers are left
unconfigured (``log_config=None``) so its start-up and access lines take the same level and format.
The flags travel to the built-in engine's process through ``CACHEGW_LOG_LEVEL``/``CACHEGW_LOG_FORMAT``.
"""

from __future__ import annotations

import json
import logging
import os
from contextvars import ContextVar
from datetime import UTC, datetime

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")
LEVEL_ENV, FORMAT_ENV = "CACHEGW_LOG_LEVEL", "CACHEGW_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# The request being served (set where a request's flow begins, gateway/request/flow.py); a record's own
# ``request_id`` (``extra=``) wins.
REQUEST_ID: ContextVar[str | None] = ContextVar("cachegw_request_id", default=None)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts (UTC, ISO 8601), level, logger, message, request_id when known, and
    the traceback as ``exc_info`` when there is one, so a log shipper needs no parsing rules."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        if request_id:
            line["request_id"] = request_id
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """The root logger at ``level`` with one stderr handler in ``fmt``; the choice is exported to the
    environment so a child `cachegw backend` logs the same way."""
    root = logging.getLogger()
    root.setLevel(level)
    os.environ[LEVEL_ENV], os.environ[FORMAT_ENV] = level, fmt
    if fmt == "json":  # progress bars (loading the index, converting a model) would break the lines
        os.environ.setdefault("TQDM_DISABLE", "1")
    logging.captureWarnings(fmt == "json")  # Python's warnings as log lines too
    for old in [h for h in root.handlers if getattr(h, "cachegw", False)]:
        root.removeHandler(old)  # a second call replaces ours
    if root.handlers:
        return  # logging set up by whoever runs us (pytest, an embedding program): as basicConfig
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.cachegw = True  # type: ignore[attr-defined]
    root.addHandler(handler)


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """A flag's default from the environment; a value not among ``choices`` is a ValueError naming it."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if value.upper() in choices or value.lower() in choices:
        return value.upper() if value.upper() in choices else value.lower()
    raise ValueError(f"environment variable {name}={value!r}: one of {', '.join(choices)}")
