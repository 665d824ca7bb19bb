"""The request id on every router log line.

The gateway sets `request_id` (a contextvar, so it follows the request into every task it
starts); `RequestIdFilter`, installed on the root handlers by `install()`, prefixes each record
logged inside a request with `[<request id>]`. The id also goes to the workers (the
GenerateRequest's request_id and `x-request-id` gRPC metadata) and back to the client
(`X-Request-Id` header, the response's `id`).
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")

_VALID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def new_request_id(prefix: str, client_value: str | None = None) -> str:
    """The client's X-Request-Id when it is a sane token, else a fresh `<prefix>-<hex>`."""
    if client_value and _VALID.match(client_value):
        return client_value
    return f"{prefix}-{uuid.uuid4().hex}"


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rid = request_id.get()
        record.request_id = rid
        if rid and not getattr(record, "_rid_prefixed", False):
            record.msg = f"[{rid}] {record.msg}"
            record._rid_prefixed = True
        return True


def install() -> None:
    """Add the filter to every handler of the root logger (call after logging is configured)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
            handler.addFilter(RequestIdFilter())
