"""The gateway's logs: JSON lines on stderr (``kvroute serve``, the controller, the EPP), kept out of
``gateway/server.py`` so that the compiled build (``buildinfo.COMPILED``) never compiles a
``logging`` subclass."""

import json
import logging
import sys
from typing import Any


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is when a record is emitted, not as it was when logging was
    configured: a stream swapped out since (a test's captured stderr, closed after the test) would
    turn every later log line into a "--- Logging error ---" report."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current sys.stderr


class JsonFormatter(logging.Formatter):
    """One JSON object per log line: time, level, logger, message and the record's ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname,
                               "logger": record.name, "msg": record.getMessage()}
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(level: str = "INFO") -> None:
    """Structured (JSON-lines) logs; request logs carry ids, replicas and timings, never prompts."""
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("kvroute")
    root.handlers[:] = [handler]
    root.setLevel(level)
