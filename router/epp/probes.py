"""Each endpoint's own readiness: the EPP asks every sidecar, not only the worker behind it.

The EPP watches the decode workers over gRPC, but the gateway dials their sidecars. A sidecar
that is gone (killed, OOM, its pod deleted) leaves its worker healthy in the EPP's eyes, and
every pick of that pod would be a failed request. So a probe loop asks each endpoint for
`/ready` every PROBE_INTERVAL_S (the sidecar answers 200 when it is up and its decode worker is
healthy), on one kept-alive connection per endpoint: a new TCP connection and its setup in both
processes ten times a second was most of an idle EPP path's CPU (bench/epp_overhead.py):

    200                              -> ready
    any other status, refused, reset -> not ready at once (a dead process refuses at once; a kept
                                        connection the endpoint closed is retried once on a
                                        new one first, so its keep-alive timeout is no outage)
    no answer within PROBE_TIMEOUT_S -> not ready after SLOW_PROBES_DOWN such probes in a row (a
                                        busy sidecar on a loaded node answers late, not never)

so an endpoint that goes away stops being picked within PROBE_INTERVAL_S + PROBE_TIMEOUT_S
(0.6 s) when it refuses, and within 2 intervals plus 2 timeouts (1.2 s) when it hangs. An endpoint
never probed yet is not ready. The loop is the state's only writer; the picker reads `is_ready`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.2
PROBE_TIMEOUT_S = 0.4
SLOW_PROBES_DOWN = 2
MAX_HEAD_BYTES = 16 * 1024  # a probe answer's status line and headers


class EndpointProbe:
    def __init__(self, endpoints: Callable[[], set[str]], path: str = "/ready", gauge=None):
        """`endpoints()` is read before every round: the endpoints of the pool's decode workers now.
        `gauge` (a prometheus Gauge labelled by endpoint) gets 1 / 0 per endpoint."""
        self.endpoints = endpoints
        self.gauge = gauge
        self.path = path
        self._ready: set[str] = set()
        self._known: set[str] = set()
        self._slow: dict[str, int] = {}
        self._conns: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self._task: asyncio.Task | None = None

    def is_ready(self, endpoint: str) -> bool:
        return endpoint in self._ready

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="epp endpoint probes")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.close()

    async def close(self) -> None:
        """Close the kept connections."""
        for endpoint in list(self._conns):
            self._drop(endpoint)

    async def probe_once(self) -> None:
        """One round over every endpoint, concurrently."""
        current = set(self.endpoints())
        await asyncio.gather(*(self._probe(e) for e in current))
        for gone in self._known - current:
            self._drop(gone)
            self._ready.discard(gone)
            if self.gauge is not None:
                self.gauge.remove(gone)
        self._known = current
        self._slow = {e: n for e, n in self._slow.items() if e in current}

    async def _run(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(PROBE_INTERVAL_S)

    async def _probe(self, endpoint: str) -> None:
        try:
            status = await asyncio.wait_for(self._status(endpoint), PROBE_TIMEOUT_S)
        except TimeoutError:
            self._drop(endpoint)  # an answer may still come on it: its state is unknown
            self._slow[endpoint] = self._slow.get(endpoint, 0) + 1
            if self._slow[endpoint] >= SLOW_PROBES_DOWN:
                self._set(endpoint, False, "no answer")
            return
        except (OSError, ValueError) as exc:
            self._drop(endpoint)
            self._set(endpoint, False, type(exc).__name__)
            return
        self._slow.pop(endpoint, None)
        self._set(endpoint, status == 200, f"status {status}")

    async def _status(self, endpoint: str) -> int:
        """The status of one GET on the endpoint's kept connection (a new one if it has none, or
        if the kept one fails: the endpoint may have closed it)."""
        kept = self._conns.get(endpoint)
        if kept is not None:
            try:
                return await self._ask(endpoint, *kept)
            except (OSError, ValueError, asyncio.IncompleteReadError):
                self._drop(endpoint)
        host, _, port = endpoint.rpartition(":")
        self._conns[endpoint] = await asyncio.open_connection(host.strip("[]"), int(port), limit=MAX_HEAD_BYTES)
        try:
            return await self._ask(endpoint, *self._conns[endpoint])
        except asyncio.IncompleteReadError:
            raise ValueError(f"{endpoint} closed the connection mid-answer") from None

    async def _ask(self, endpoint: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        writer.write(f"GET {self.path} HTTP/1.1\r\nHost: {endpoint}\r\n\r\n".encode())
        await writer.drain()
        try:  # the status line and headers in one read: a probe is most of an idle EPP's work
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise ValueError(f"{endpoint} answered with headers over {MAX_HEAD_BYTES} bytes") from None
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        try:
            status = int(status_line.split()[1])
        except (IndexError, ValueError):
            raise ValueError(f"no HTTP status line from {endpoint}") from None
        if "content-length" in headers and headers.get("connection") != "close":
            await reader.readexactly(int(headers["content-length"]))
        else:  # a body of unknown length, or the endpoint closes: no reuse
            self._drop(endpoint)
        return status

    def _drop(self, endpoint: str) -> None:
        conn = self._conns.pop(endpoint, None)
        if conn is not None:
            conn[1].close()

    def _set(self, endpoint: str, is_ready: bool, why: str) -> None:
        if self.gauge is not None:
            self.gauge.labels(endpoint=endpoint).set(1 if is_ready else 0)
        if is_ready == (endpoint in self._ready):
            return
        if is_ready:
            self._ready.add(endpoint)
            log.info("endpoint %s is ready", endpoint)
        else:
            self._ready.discard(endpoint)
            log.warning("endpoint %s is not ready (%s): no longer picked", endpoint, why)
