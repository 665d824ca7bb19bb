"""The saturation detector: may a request of a given band be dispatched now?

It reads what the router already knows of each decode worker (router/placement/pool.py's WorkerState):
its last load report (waiting and running requests, KV-cache use, draining) and the router's
own live counts of the requests it assigned there. A healthy, non-draining decode worker is
*full* when any of these holds (GIE's detector, plus a running cap):

- its waiting requests (the report's, or the router's pending assignments if more) reach
  `queue_depth_threshold`;
- its KV-cache use reaches `kv_cache_threshold`;
- its load report is older than `load_staleness_s` (no news is treated as no room);
- with `max_running_per_worker` > 0: the requests this router has in flight there reach the
  band's running limit, which is lower by `reserved_running` for bands under
  `reserved_min_band`; without it (and `latency_cap` on, the default) the limit is the worker's
  latency cap (router/flow/latency.py: the batch whose measured step time stays within the
  target, one more for the reserved bands). The router's own count, not the load report's: it changes the moment a
  request ends, where a report lags by up to its interval (0.5 s), long enough to hold an
  interactive request back for nothing. So the cap is per router replica (as
  `max_concurrent_per_key` is); other replicas' requests show through the waiting threshold.

The pool has room for a band while some worker is not full and, with a running cap, the
requests the controller has dispatched and not seen end are fewer than the cap times the
workers with room: a request released a moment ago counts before its worker reports it.

With latency caps the bands at or above `reserved_min_band` also have slots of their own: while
fewer of their requests are in flight than the latency caps of the workers not full by queue
depth, KV use or staleness add up to, one may go whatever the batch bands hold. A worker's cap
follows a measured, noisy step time; when it drops, the batch requests above it drain at their
own pace, and an interactive request must not wait for that.

With no healthy decode worker at all (a pool scaled to zero, a restart) nothing is dispatched:
requests wait in the gateway's queue, bounded, while the pool comes up.

Prefill workers are not gated: a saturated prefill pool shows as waiting requests on the
decode workers that wait for its KV.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from splitserve.router.config.flow import FlowControlConfig
from splitserve.router.flow.latency import StepFit, band_limit


class SaturationDetector:
    def __init__(self, config: FlowControlConfig, workers: Callable[[], Iterable], clock=time.monotonic):
        """`workers()` returns the router's WorkerState objects (read only)."""
        self.config = config
        self.workers = workers
        self.clock = clock
        self.fits: dict[str, StepFit] = {}  # worker address -> its step-time line (latency caps)

    def observe_step(self, worker, step_s: float) -> None:
        """A token message from `worker` came `step_s` seconds per token after the previous one
        (router/core/worker_calls.py calls this when latency caps are on)."""
        load = worker.load
        num_running = max(worker.num_inflight, load.num_running if load is not None else 0)
        self.fits.setdefault(worker.address, StepFit()).observe(num_running, step_s)

    def limit(self, worker, band: int) -> int:
        """The running limit of `band` on `worker` (0: none)."""
        cfg = self.config
        if not cfg.is_latency_capped:
            return cfg.running_limit(band)
        fit = self.fits.get(worker.address) or StepFit()
        return band_limit(fit.max_running(cfg.latency_slack, cfg.itl_target_s), band >= cfg.reserved_min_band)

    def _candidates(self, now: float) -> list:
        return [
            w for w in self.workers() if w.can_decode and w.is_healthy(now) and (w.load is None or not w.load.draining)
        ]

    def is_loaded(self, worker, now: float) -> bool:
        """Full whatever the band: its report stale, or its queue depth or KV use at the threshold."""
        cfg, load = self.config, worker.load
        if load is None or now - worker.load_time > cfg.load_staleness_s:
            return True
        return max(load.num_waiting, worker.num_pending) >= cfg.queue_depth_threshold or (
            load.kv_usage >= cfg.kv_cache_threshold
        )

    def is_full(self, worker, band: int, now: float) -> bool:
        if self.is_loaded(worker, now):
            return True
        limit = self.limit(worker, band)
        return bool(limit) and self.busy(worker) >= limit

    @staticmethod
    def busy(worker) -> int:
        return worker.num_inflight

    def has_room(self, band: int, num_dispatched: int, num_reserved_dispatched: int = 0) -> bool:
        """May one more request of `band` go to the workers, with `num_dispatched` of the
        controller's requests out there now (released and not yet ended), of them
        `num_reserved_dispatched` of the bands >= reserved_min_band?"""
        now = self.clock()
        candidates = self._candidates(now)
        if self._has_reserved_slot(band, num_reserved_dispatched, candidates, now):
            return True
        is_open = [not self.is_full(w, band, now) for w in candidates]
        if not any(is_open):
            return False
        limits = [self.limit(w, band) for w in candidates]
        if not any(limits):
            return True
        # Slots: the band's limit on each worker with room; a full worker only what it holds.
        # Released requests count before placement assigns them to a worker.
        busy = [self.busy(w) for w in candidates]
        num_slots = sum(limit if o else min(b, limit) for o, b, limit in zip(is_open, busy, limits, strict=True))
        return max(num_dispatched, sum(busy)) < num_slots

    def _has_reserved_slot(self, band: int, num_reserved_dispatched: int, candidates: list, now: float) -> bool:
        """Latency caps: in-flight requests of the reserved bands up to the caps of the workers not loaded."""
        cfg = self.config
        if not cfg.is_latency_capped or band < cfg.reserved_min_band:
            return False
        return num_reserved_dispatched < sum(self.limit(w, band) for w in candidates if not self.is_loaded(w, now))

    def is_saturated(self) -> bool:
        """GIE's question, for metrics and shedding: no worker has room for band 0."""
        return not self.has_room(0, 0)
