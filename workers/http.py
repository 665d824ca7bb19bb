"""The worker's HTTP side port: /health (alive), /ready (model loaded, warmed up, not draining),
/metrics (Prometheus text), /debug/kv (block pool state and invariants, JSON; for tests and
SREs — the port is cluster-internal), /debug/requests/<request id> (where a recent request's time
went, JSON: workers/records.py; `splitserve trace` reads it). A minimal asyncio server: GET only,
one response per connection, so it needs no web framework in the worker image.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections.abc import Awaitable, Callable

CONTENT_TYPE_METRICS = "text/plain; version=0.0.4; charset=utf-8"


class HealthServer:
    def __init__(
        self,
        host: str,
        port: int,
        is_ready: Callable[[], tuple[bool, str]],
        render_metrics: Callable[[], bytes],
        debug_kv: Callable[[], Awaitable[dict]] | None = None,
        debug_request: Callable[[str], dict | None] | None = None,
    ):
        self.host, self.port = host, port
        self.debug_request = debug_request
        self.debug_kv = debug_kv
        self.is_ready = is_ready
        self.render_metrics = render_metrics
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]  # the port bound (port 0: the kernel's pick)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), timeout=10)
            while (await asyncio.wait_for(reader.readline(), timeout=10)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request_line.decode("latin-1").split()
            if len(parts) >= 2 and parts[0] == "GET" and parts[1] == "/debug/kv" and self.debug_kv is not None:
                status, ctype, body = "200 OK", "application/json", json.dumps(await self.debug_kv()).encode()
            else:
                status, ctype, body = self._route(parts)
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def _route(self, parts: list[str]) -> tuple[str, str, bytes]:
        if len(parts) < 2 or parts[0] != "GET":
            return "405 Method Not Allowed", "text/plain", b"only GET is supported\n"
        path = parts[1].split("?", 1)[0]
        if path == "/health":
            return "200 OK", "text/plain", b"ok\n"
        if path == "/ready":
            ready, why = self.is_ready()
            return ("200 OK" if ready else "503 Service Unavailable"), "text/plain", (why + "\n").encode()
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_METRICS, self.render_metrics()
        if path.startswith("/debug/requests/") and self.debug_request is not None:
            record = self.debug_request(urllib.parse.unquote(path[len("/debug/requests/") :]))
            if record is None:
                return "404 Not Found", "text/plain", b"no recent request with that id on this worker\n"
            return "200 OK", "application/json", json.dumps(record).encode()
        return "404 Not Found", "text/plain", b"not found; try /health, /ready or /metrics\n"
