"""Errors the gateway answers, in OpenAI's error JSON:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

400 invalid input (also a prompt over the context length, with the lengths), 401 missing or
wrong API key, 404 unknown model, 409 an adapter load/unload while the adapters are declared,
413 body too large, 429 rate limit or full admission queue or saturated workers (with
Retry-After), 503 no worker can serve (with Retry-After), 500 a bug.

This module is at the bottom of the router: placement/, flow/, tenancy/ and core/ raise these
errors without importing the API layer, and api/app.py answers them.
"""

from __future__ import annotations

import math

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An answer for the client: HTTP `status`, a message saying what was wrong and what is allowed."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.extra_headers = headers or {}
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return dict(self.extra_headers)
        return {**self.extra_headers, "Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}
    }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class NoWorkerError(APIError):
    """Placement found no worker for the request (503, or 429 when all are saturated)."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(
            status, message, code="no_worker_available" if status == 503 else "workers_saturated", retry_after_s=1.0
        )
