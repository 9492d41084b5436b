"""``--log-format json``: one JSON object per log line.

Fields: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, and for the access log
(:mod:`redlite.server.access`) the request's fields (``request_id``, ``session_key``,
``prompt``, ``reused``, ``prefilled``, ``generated``, ``ttft_ms``, ``miss_reason``, ...);
``exception`` with the traceback text when one is logged.
"""

from __future__ import annotations

import datetime
import json
import logging


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
               .isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "logger": record.name,
               "message": record.getMessage()}
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            out.update(access)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def use_json(logger: logging.Logger | None = None) -> None:
    """Give every handler of ``logger`` (default: the root logger) the JSON formatter."""
    for handler in (logger or logging.getLogger()).handlers:
        handler.setFormatter(JsonFormatter())
