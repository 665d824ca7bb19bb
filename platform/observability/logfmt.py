"""Log lines that correlate with traces, as text or as JSON.

`setup(level, fmt)` configures the root logger on stderr. Every record gets `trace_id` and
`span_id`: those of the span the running task activated (observability/tracing.py, `Span.activate`),
empty outside a traced request. Text lines append ` trace_id=… span_id=…` when there are ids;
`fmt="json"` (`--log-format json` or SPLITSERVE_LOG_FORMAT=json) writes one JSON object per
line with `time`, `level`, `logger`, `message`, the ids, `request_id` where the gateway set one,
and `exception` for a traceback — what Loki or any log pipeline parses without a regex.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from splitserve.platform.observability import tracing

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(trace_suffix)s"


class TraceContextFilter(logging.Filter):
    """Stamps each record with the running task's trace and span ids."""

    def filter(self, record: logging.LogRecord) -> bool:
        trace_id, span_id = tracing.current_ids.get()
        record.trace_id, record.span_id = trace_id, span_id
        record.trace_suffix = f" trace_id={trace_id} span_id={span_id}" if trace_id else ""
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("request_id", "trace_id", "span_id"):
            value = getattr(record, key, "")
            if value:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def log_format(value: str | None = None) -> str:
    """The format asked for (flag first, then SPLITSERVE_LOG_FORMAT, else text), validated."""
    fmt = (value or os.environ.get("SPLITSERVE_LOG_FORMAT") or "text").strip().lower()
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is invalid; allowed: {', '.join(FORMATS)}")
    return fmt


def setup(level: str, fmt: str = "text", stream=None) -> logging.Handler:
    """Configure the root logger (replacing its handlers); returns the handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(TraceContextFilter())
    handler.setFormatter(JsonFormatter() if log_format(fmt) == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
