"""Which worker replicas of a Ray Serve deployment are alive, and where they listen.

A Serve deployment (one replica, no CPU) that the worker replicas heartbeat into every second
through a DeploymentHandle (rayserve/replica.py) and the gateway's `RayDiscovery` reads
(rayserve/discovery.py). An entry is `{address, role, metrics, actor_name, replica_id}`; a replica
that stops heartbeating for `stale_after_s` is dropped (it was killed, or its node was lost), one
that stops gracefully unregisters itself — and a heartbeat it sent just before, which may arrive
after, is ignored for `stale_after_s` (a tombstone), so a stopped replica never returns. The
registry keeps no other state: if Serve restarts it, the next round of heartbeats rebuilds it within
a second.
"""

from __future__ import annotations

import time

STALE_AFTER_S = 3.0


class WorkerRegistry:
    def __init__(self, stale_after_s: float = STALE_AFTER_S, clock=time.monotonic):
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._entries: dict[str, tuple[dict, float]] = {}
        self._gone: dict[str, float] = {}  # unregistered address -> when

    def register(self, info: dict) -> None:
        """A heartbeat: add or refresh the replica at `info["address"]`."""
        now = self.clock()
        self._gone = {a: t for a, t in self._gone.items() if now - t <= self.stale_after_s}
        if info["address"] not in self._gone:
            self._entries[info["address"]] = (dict(info), now)

    def unregister(self, address: str) -> None:
        self._entries.pop(address, None)
        self._gone[address] = self.clock()

    def workers(self) -> list[dict]:
        """The live replicas, stale ones dropped first."""
        now = self.clock()
        for address, (_, seen) in list(self._entries.items()):
            if now - seen > self.stale_after_s:
                del self._entries[address]
        return [info for info, _ in self._entries.values()]
