"""Structured JSON-lines logging (SPEC RT.2): ``ts``, ``level``, ``module_id``, ``rank``, ``msg`` plus extra fields.

Every record is one line. Extra fields are passed with ``logger.info("step", extra={"fields": {...}})`` or with
:func:`log_event`, which is the form the engine uses for per-step metrics.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

#: prefix of a structured line on a worker's stdout, so the launcher can tell it from free text
EVENT_PREFIX = "KC_EVENT "
#: one event line at a time: rank 0's step feed writes from its own thread
_EMIT_LOCK = threading.Lock()


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object on one line."""

    def __init__(self, module_id: str, rank: int | None):
        super().__init__()
        self.module_id = module_id
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "module_id": self.module_id,
            "rank": self.rank,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            payload.update(fields)
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str, ensure_ascii=False)


def setup_logging(
    module_id: str,
    rank: int | None = None,
    level: str = "INFO",
    json_file: str | Path | None = None,
    stream: TextIO | None = None,
) -> logging.Logger:
    """Configure the ``kuangchao`` logger tree to write JSON lines to ``stream`` (stderr) and ``json_file``.

    Returns the ``kuangchao`` logger. Calling it again replaces the handlers (idempotent).
    """
    root = logging.getLogger("kuangchao")
    root.setLevel(level.upper())
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    formatter = JsonFormatter(module_id, rank)
    console = logging.StreamHandler(stream or sys.stderr)
    console.setFormatter(formatter)
    root.addHandler(console)
    if json_file:
        path = Path(json_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(path, encoding="utf-8")
        file_handler.setFormatter(formatter)
        root.addHandler(file_handler)
    root.propagate = False
    return root


def log_event(logger: logging.Logger, msg: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``msg`` with structured ``fields`` merged into the JSON line."""
    logger.log(level, msg, extra={"fields": fields})


def emit_event(kind: str, /, stream: TextIO | None = None, **fields: Any) -> None:
    """Write one machine-readable event line (``KC_EVENT {json}``) to stdout for the launcher's live view."""
    out = stream or sys.stdout
    line = EVENT_PREFIX + json.dumps({"event": kind, **fields}, default=str) + "\n"
    with _EMIT_LOCK:
        out.write(line)
        out.flush()


def parse_event(line: str) -> dict[str, Any] | None:
    """The event dict of a ``KC_EVENT`` line (possibly behind a launcher prefix), or None for other lines."""
    pos = line.find(EVENT_PREFIX)
    if pos < 0:
        return None
    try:
        value = json.loads(line[pos + len(EVENT_PREFIX) :])
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
