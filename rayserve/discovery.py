"""Discovery through Ray: the worker replicas the registry deployment knows (rayserve/registry.py).

`RayDiscovery` polls `fetch()` (in the gateway: the registry's `workers` method through a
DeploymentHandle) every `interval_s` and reports the address set to the router whenever it
changes, so replicas Serve adds (autoscaling, replacement) are watched within a poll and replicas
that leave are forgotten. A failed poll (the registry restarting) keeps the last set and is
retried; the router's own watchers already mark a dead worker down the moment its stream breaks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from splitserve.router.placement.discovery import OnChange

log = logging.getLogger(__name__)


class RayDiscovery:
    def __init__(self, fetch: Callable[[], Awaitable[list[dict]]], interval_s: float = 0.5):
        self.fetch = fetch
        self.interval_s = interval_s

    async def run(self, on_change: OnChange) -> None:
        known: set[str] | None = None
        while True:
            try:
                addresses = {info["address"] for info in await self.fetch()}
            except Exception as exc:  # noqa: BLE001 — the registry is (re)starting; keep the last set
                log.warning("worker registry unavailable (%s); keeping %d known workers", exc, len(known or ()))
            else:
                if addresses != known:
                    await on_change(addresses)
                    known = addresses
            await asyncio.sleep(self.interval_s)
