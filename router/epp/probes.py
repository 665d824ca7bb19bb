"""Each endpoint's own readiness: the EPP asks every sidecar, not only the worker behind it.

The EPP watches the decode workers over gRPC, but the gateway dials their sidecars. A sidecar
that is gone (killed, OOM, its pod deleted) leaves its worker healthy in the EPP's eyes, and
every pick of that pod would be a failed request. So a probe loop asks each endpoint for
`/ready` every PROBE_INTERVAL_S (the sidecar answers 200 when it is up and its decode worker is
healthy):

    200                              -> ready
    any other status, refused, reset -> not ready at once (a dead process refuses at once)
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
        self._task: asyncio.Task | None = None

    def is_ready(self, endpoint: str) -> bool:
        return endpoint in self._ready

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="epp endpoint probes")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def probe_once(self) -> None:
        """One round over every endpoint, concurrently."""
        current = set(self.endpoints())
        await asyncio.gather(*(self._probe(e) for e in current))
        for gone in self._known - current:
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
            self._slow[endpoint] = self._slow.get(endpoint, 0) + 1
            if self._slow[endpoint] >= SLOW_PROBES_DOWN:
                self._set(endpoint, False, "no answer")
            return
        except (OSError, ValueError) as exc:
            self._set(endpoint, False, type(exc).__name__)
            return
        self._slow.pop(endpoint, None)
        self._set(endpoint, status == 200, f"status {status}")

    async def _status(self, endpoint: str) -> int:
        host, _, port = endpoint.rpartition(":")
        reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        try:
            writer.write(f"GET {self.path} HTTP/1.1\r\nHost: {endpoint}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            line = await reader.readline()
            return int(line.split()[1])
        except IndexError:
            raise ValueError(f"no HTTP status line from {endpoint}") from None
        finally:
            writer.close()

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
