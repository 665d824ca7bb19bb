"""Scale from zero: hold a request while the decode pool has no worker, instead of failing it.

When a pool is scaled to zero, the first request is the demand signal. Failing it at once
(503) loses it; holding it forever piles requests up. So a request that finds no decode worker
waits until one is known (polled every `poll_s`) for at most `timeout_s`, and at most
`max_held` requests wait at once; beyond either bound it gets 503 with Retry-After. The number
held is the gauge `splitserve_router_held_requests`, which a scaler reads as demand on an
empty pool. `timeout_s` 0 turns holding off (the router's behaviour before scale from zero).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from splitserve.router.errors import NoWorkerError


class ColdStartHold:
    """Owned by the dispatcher; `wait` is called before each placement."""

    def __init__(self, timeout_s: float, max_held: int, gauge=None, poll_s: float = 0.05):
        self.timeout_s, self.max_held, self.poll_s = timeout_s, max_held, poll_s
        self.gauge = gauge
        self.num_held = 0

    async def wait(self, has_worker: Callable[[], bool]) -> None:
        """Return once `has_worker()` is true; NoWorkerError (503, Retry-After) when the hold
        is off, full, or times out."""
        if has_worker() or self.timeout_s <= 0:
            return
        if self.num_held >= self.max_held:
            raise NoWorkerError(
                f"no decode worker yet and {self.num_held} requests already wait for one "
                f"(gateway.cold_start_max_held={self.max_held}); retry later"
            )
        self._add(1)
        try:
            deadline = time.monotonic() + self.timeout_s
            while not has_worker():
                if time.monotonic() >= deadline:
                    raise NoWorkerError(
                        f"no decode worker became ready within {self.timeout_s:g} s "
                        "(gateway.cold_start_hold_s); retry later"
                    )
                await asyncio.sleep(self.poll_s)
        finally:
            self._add(-1)

    def _add(self, n: int) -> None:
        self.num_held += n
        if self.gauge is not None:
            self.gauge.set(self.num_held)
