"""The gateway's edge: the ASGI middleware every request passes first (router/api/app.py installs it).

It gives each request its id (X-Request-Id in and out, on every log line), enforces the header
and body size limits (431, 413), counts the request metrics and opens the request's trace span.
"""

from __future__ import annotations

import logging
import time

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve.platform.observability import tracing
from splitserve.router import logctx
from splitserve.router.errors import error_body

log = logging.getLogger("splitserve.router.api.app")

_PREFIXES = {"/v1/chat/completions": "chatcmpl", "/v1/completions": "cmpl"}
_DRAIN_LIMIT = 64 * 1024 * 1024  # past this an oversized body is not read before answering


MAX_HEADER_BYTES = 16 * 1024


def _request_span(scope, headers: dict, path: str, rid: str):
    tracer = tracing.tracer()
    if not tracer.enabled or not path.startswith("/v1/"):
        return tracing.NOOP
    return tracer.start(
        "gateway.request",
        tracing.http_carrier(headers),
        attributes={"http.request.method": scope.get("method", ""), "url.path": path, "splitserve.request_id": rid},
    )


class EdgeMiddleware:
    """Request id (X-Request-Id in and out, on every log line), body size limit, request metrics,
    and the request's trace span (`gateway.request`, a child of the client's `traceparent`; the
    running task's current span, so the gateway's spans below nest under it)."""

    def __init__(self, app, max_body_bytes: int, metrics):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        client_rid = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = logctx.new_request_id(_PREFIXES.get(path, "req"), client_rid)
        scope.setdefault("state", {})["is_client_request_id"] = rid == client_rid
        token = logctx.request_id.set(rid)
        status = [500]
        t0 = time.monotonic()
        span = _request_span(scope, headers, path, rid)
        trace_tokens = tracing.enter(span)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            header_bytes = sum(len(k) + len(v) for k, v in scope.get("headers") or [])
            if header_bytes > MAX_HEADER_BYTES:  # whatever the HTTP parser allowed
                response = JSONResponse(
                    error_body(
                        431,
                        f"request headers too large: {header_bytes} bytes, the limit is {MAX_HEADER_BYTES}",
                        code="headers_too_large",
                    ),
                    431,
                )
                await response({"type": "http"}, receive, send_with_id)
                return
            length = headers.get(b"content-length", b"")
            if length.isdigit() and int(length) > self.max_body_bytes:
                await self._reject_oversized(receive, send_with_id, int(length))
                return
            await self.app(scope, self._limited(receive), send_with_id)
        finally:
            if path.startswith("/v1/"):
                elapsed = time.monotonic() - t0
                self.metrics.requests.labels(endpoint=path, status=str(status[0])).inc()
                self.metrics.latency.labels(endpoint=path).observe(elapsed)
                log.info("%s %s -> %d in %.3f s", scope.get("method"), path, status[0], elapsed)
            if span.is_recording:
                span.set("http.response.status_code", status[0])
                if status[0] >= 500:
                    span.fail(RuntimeError(f"HTTP {status[0]}"))
                span.end()
            tracing.leave(trace_tokens)
            logctx.request_id.reset(token)

    def _limited(self, receive):
        seen = [0]

        async def wrapped():
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_body_bytes:
                    raise StarletteHTTPException(413, self._too_large())
            return message

        return wrapped

    def _too_large(self) -> str:
        return f"request body too large; the limit is {self.max_body_bytes} bytes"

    async def _reject_oversized(self, receive, send, length: int) -> None:
        if length <= _DRAIN_LIMIT:  # read it so the client can finish sending and read our answer
            more = True
            while more:
                message = await receive()
                more = message["type"] == "http.request" and message.get("more_body", False)
        response = JSONResponse(error_body(413, self._too_large() + f", got {length}", code="request_too_large"), 413)
        await response({"type": "http"}, receive, send)
