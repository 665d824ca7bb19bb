"""The flow controller: requests wait in the gateway, by band and flow, until the workers have room.

    acquire(item)  -> dispatched now            (room, and nothing queued at its band or above)
                   -> queued, then dispatched   (in band order, fair queuing within a band)
                   -> APIError 503 / 429         (turned away, with Retry-After)
    release(item, used_tokens)                   once, when a dispatched request ends

Rules, in the order they apply:

1. Bands are strict: the highest band with queued requests is served first, and while it has no
   room nothing below it is dispatched. Within a band, router/flow/fairness.py picks the flow.
2. The saturation detector (router/flow/saturation.py) decides whether there is room. Every
   queued request is reconsidered when a dispatched one ends and on a short tick while anything
   waits (load reports change the answer too).
3. Sheddable requests (band < 0) never wait: with no room they are answered 503 at once, so
   under saturation they are the first turned away and never take queue space from a band >= 0.
4. A band's queue holds at most `max_queued_per_band`. A newcomer to a full queue whose flow
   holds more than its weighted share of the queue gets 429 (its own share is used up); if
   another flow is over its share, that flow's newest queued request gets the 429 and the
   newcomer takes its place; if no flow is over its share, the newcomer gets 503.
5. A request queued longer than `max_queue_wait_s` gets 503; a request whose client went away
   (its task cancelled) leaves the queue at once. Queued requests hold no worker memory: they
   have not been placed.

Each request is counted once in the metrics, when it leaves flow control. The controller is the
single writer of its bands; it runs on the gateway's event loop and needs no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from splitserve.router.config.flow import FlowControlConfig
from splitserve.router.errors import APIError
from splitserve.router.flow.fairness import Band, FlowItem
from splitserve.router.flow.metrics import FlowMetrics
from splitserve.router.flow.saturation import SaturationDetector

log = logging.getLogger(__name__)

TICK_S = 0.02


class FlowController:
    def __init__(
        self,
        config: FlowControlConfig,
        detector: SaturationDetector,
        metrics: FlowMetrics | None = None,
        clock=time.monotonic,
    ):
        self.config = config
        self.detector = detector
        self.metrics = metrics
        self.clock = clock
        self.bands: dict[int, Band] = {}
        self.num_dispatched = 0  # released to the workers and not yet ended
        self.num_reserved_dispatched = 0  # of them, of the bands >= reserved_min_band
        self._waiters: dict[FlowItem, asyncio.Future] = {}
        self._ticker: asyncio.Task | None = None

    # -- reading ------------------------------------------------------------------------------
    @property
    def num_queued(self) -> int:
        return sum(band.num_queued for band in self.bands.values())

    # -- the request's side ---------------------------------------------------------------------
    def try_acquire(self, item: FlowItem) -> bool:
        """Dispatch `item` at once if nothing of its band or above waits and there is room (the
        idle path, without a task); False: call acquire()."""
        item.enqueue_time = self.clock()
        if self._queued_from(item.band) or not self._has_room(item.band):
            return False
        band = self.bands.setdefault(item.band, Band(item.band))
        band.push(item)
        self._dispatch_next(band)
        return True

    async def acquire(self, item: FlowItem) -> None:
        """Return when `item` may go to the workers (then call release() once when it ends), or
        raise APIError 503/429. Cancelling the caller takes the item out of its queue at once."""
        if self.try_acquire(item):
            return
        band = self.bands.setdefault(item.band, Band(item.band))
        self._make_room(band, item)
        band.push(item)
        self._count_queued(item, +1)
        future = asyncio.get_running_loop().create_future()
        self._waiters[item] = future
        self._ensure_ticker()
        self._dispatch_all()
        try:
            await asyncio.wait(
                {future}, timeout=max(0.0, item.enqueue_time + self.config.max_queue_wait_s - self.clock())
            )
        except asyncio.CancelledError:
            if not self._leave_queue(item, "cancelled") and future.done() and future.exception() is None:
                self.release(item, 0)  # dispatched as its client left: give the room back
            raise
        if not future.done() and self._leave_queue(item, "shed"):
            raise self._error(
                503,
                item,
                f"the workers stayed saturated for the {self.config.max_queue_wait_s:g} s "
                f"a request of band {item.band} may wait; retry later",
                "queue_timeout",
            )
        future.result()  # raises the 429 of a request turned away from a full queue

    def release(self, item: FlowItem, used_tokens: int | None) -> None:
        """A dispatched request ended: settle its flow's charge to `used_tokens` (prompt +
        completion tokens; None keeps the reservation) and let the next one go."""
        self.bands[item.band].settle(item, used_tokens)
        self.num_dispatched -= 1
        self.num_reserved_dispatched -= self._is_reserved(item)
        assert self.num_dispatched >= 0 and self.num_reserved_dispatched >= 0
        self._dispatch_all()

    # -- rules ----------------------------------------------------------------------------------
    def _is_reserved(self, item: FlowItem) -> bool:
        return item.band >= self.config.reserved_min_band

    def _has_room(self, band: int) -> bool:
        return self.detector.has_room(band, self.num_dispatched, self.num_reserved_dispatched)

    def _queued_from(self, band: int) -> bool:
        return any(b >= band and q.num_queued for b, q in self.bands.items())

    def _make_room(self, band: Band, item: FlowItem) -> None:
        """Rules 3 and 4: raise if `item` cannot queue; evict an over-share request if that makes room."""
        if item.is_sheddable:
            self._count_left(item, "shed")
            raise self._error(
                503, item, f"the workers are saturated and band {item.band} is sheddable; retry later", "sheddable_shed"
            )
        if self.config.max_queue_wait_s == 0 or band.num_queued < self.config.max_queued_per_band:
            return
        over = band.most_over_share(item)
        if over == item.flow_id:
            self._count_left(item, "rejected")
            raise self._error(
                429,
                item,
                f"flow {item.flow_id!r} already holds more than its share of the "
                f"{self.config.max_queued_per_band} queued requests band {item.band} may hold; "
                "retry later",
                "flow_share_exceeded",
            )
        if over is None:
            self._count_left(item, "shed")
            raise self._error(
                503,
                item,
                f"the workers are saturated and band {item.band}'s queue is full "
                f"({self.config.max_queued_per_band} requests); retry later",
                "queue_full",
            )
        victim = band.newest_of(over)
        future = self._waiters[victim]
        self._leave_queue(victim, "rejected")
        future.set_exception(
            self._error(
                429,
                victim,
                f"flow {over!r} holds more than its share of band {victim.band}'s full queue and "
                "another tenant needed the place; retry later",
                "flow_share_exceeded",
            )
        )

    def _dispatch_all(self) -> None:
        """Rules 1 and 2: release queued requests, highest band first, while there is room."""
        for number in sorted(self.bands, reverse=True):
            band = self.bands[number]
            while band.num_queued:
                if not self._has_room(number):
                    return
                item = self._dispatch_next(band)
                self._count_queued(item, -1)
                self._waiters.pop(item).set_result(None)

    def _dispatch_next(self, band: Band) -> FlowItem:
        item = band.pop()
        self.num_dispatched += 1
        self.num_reserved_dispatched += self._is_reserved(item)
        self._count_left(item, "dispatched")
        return item

    def _leave_queue(self, item: FlowItem, outcome: str) -> bool:
        if not self.bands[item.band].remove(item):
            return False
        self._waiters.pop(item, None)
        self._count_queued(item, -1)
        self._count_left(item, outcome)
        return True

    def _error(self, status: int, item: FlowItem, message: str, code: str) -> APIError:
        log.info(
            "flow control: %s (band %d, flow %s) answered %d: %s", item.req_id, item.band, item.flow_id, status, code
        )
        return APIError(status, message, code=code, retry_after_s=self.config.retry_after_s)

    # -- the tick -------------------------------------------------------------------------------
    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while self.num_queued:
            await asyncio.sleep(TICK_S)
            self._dispatch_all()

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    # -- metrics --------------------------------------------------------------------------------
    def _count_queued(self, item: FlowItem, delta: int) -> None:
        if self.metrics is not None:
            self.metrics.queued(item.band, item.label or item.flow_id, delta)

    def _count_left(self, item: FlowItem, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.left(item.band, item.label or item.flow_id, outcome, self.clock() - item.enqueue_time)
