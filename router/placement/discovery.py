"""Where the workers are. A discovery source reports the full set of worker gRPC addresses
whenever it changes; the router starts a watcher for each new address and forgets removed ones.
Roles come from each worker's own WorkerInfo, so one list may mix prefill and decode workers.

Sources: `StaticDiscovery` (--workers), `discovery_k8s.EndpointSliceDiscovery` (the pool
Services' EndpointSlices; router/router.py picks one from the config), and outside the router
`splitserve.rayserve.discovery.RayDiscovery`
(the replicas of the Ray Serve worker deployments, through their registry; docs/ray.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

OnChange = Callable[[set[str]], Awaitable[None]]


class Discovery(Protocol):
    async def run(self, on_change: OnChange) -> None:
        """Call `on_change(addresses)` with the complete set at start and after every change;
        return only when no further change can come (a static list), else run until cancelled."""


class StaticDiscovery:
    def __init__(self, addresses):
        self.addresses = set(addresses)

    async def run(self, on_change: OnChange) -> None:
        await on_change(set(self.addresses))
