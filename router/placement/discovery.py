"""Where the workers are. A discovery source reports the full set of worker gRPC addresses
whenever it changes; the router starts a watcher for each new address and forgets removed ones.
Roles come from each worker's own WorkerInfo, so one list may mix prefill and decode workers.

Sources: `StaticDiscovery` (--workers), `discovery_k8s.EndpointSliceDiscovery` (the pool
Services' EndpointSlices), and outside the router `splitserve.rayserve.discovery.RayDiscovery`
(the replicas of the Ray Serve worker deployments, through their registry; docs/ray.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from splitserve.router.config import DiscoveryConfig

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


def make_discovery(config: DiscoveryConfig) -> Discovery:
    if config.k8s_services:
        from splitserve.router.placement.discovery_k8s import EndpointSliceDiscovery, KubernetesSliceSource

        return EndpointSliceDiscovery(KubernetesSliceSource(config.k8s_namespace), config.k8s_services,
                                      config.k8s_port_name)
    return StaticDiscovery(config.workers)
