"""Filters: drop workers that must not get the request, before any scoring.

Each filter has a stable name (the config lists them in order), parses its params over its
DEFAULTS from the profile's `filter_params[name]`, and keeps the workers that pass (`select`:
one worker at a time through `keep`, or, for a filter that compares workers, the whole set).
When a filter leaves nobody, its `empty_status` says what the client hears: 503 (nothing can
serve: no healthy worker, all draining) or 429 (workers exist but are saturated; retry later).
"""

from __future__ import annotations

from splitserve.platform.errors import ConfigError
from splitserve.router.placement.pool import WorkerState
from splitserve.router.placement.scoring import parse_params


class Filter:
    name = ""
    DEFAULTS: dict = {}
    empty_status = 503
    empty_reason = ""

    def __init__(self, params: dict | None = None):
        self.params = parse_params(f"filter {self.name}", self.DEFAULTS, params or {})

    def keep(self, worker: WorkerState, now: float) -> bool:
        raise NotImplementedError

    def select(self, workers: list[WorkerState], now: float) -> list[WorkerState]:
        return [w for w in workers if self.keep(w, now)]


class Healthy(Filter):
    """Event stream connected, same model and block size, no recent failed call."""

    name = "healthy"
    empty_reason = "no healthy worker"

    def keep(self, worker, now):
        return worker.is_healthy(now)


class NotDraining(Filter):
    """The worker's last load report does not say it is shutting down (no report: kept)."""

    name = "not-draining"
    empty_reason = "every worker is draining"

    def keep(self, worker, now):
        return worker.load is None or not worker.load.draining


class NotSaturated(Filter):
    """Fewer than `max_waiting` requests waiting and KV usage below `max_kv_usage`."""

    name = "not-saturated"
    DEFAULTS = {"max_waiting": 64, "max_kv_usage": 0.99}
    empty_status = 429
    empty_reason = "every worker is saturated"

    def keep(self, worker, now):
        load = worker.load
        if load is None:
            return True
        return load.num_waiting < self.params["max_waiting"] and load.kv_usage < self.params["max_kv_usage"]


def load_of(worker: WorkerState) -> int:
    """Requests on the worker: waiting + running from its last report, plus those this router
    sent that have no first token yet (no report shows them)."""
    load = worker.load
    return worker.num_pending + (load.num_waiting + load.num_running if load is not None else 0)


class Balanced(Filter):
    """Drops a worker whose load exceeds the least loaded candidate's by more than `slack`
    requests *and* by a factor of more than `ratio`. Prefix and adapter affinity then choose only
    among workers of comparable load: without it, a worker holding a popular prefix or adapter
    keeps winning after its queue has outgrown every other (the load scorers stop telling
    workers apart past their saturation point). SGLang's cache-aware router guards its prefix
    tree with the same two thresholds (balance_abs_threshold, balance_rel_threshold). Never
    leaves nobody: the least loaded worker always passes."""

    name = "balanced"
    DEFAULTS = {"slack": 4, "ratio": 1.5}

    def __init__(self, params: dict | None = None):
        super().__init__(params)
        if self.params["ratio"] < 1:
            raise ConfigError(f"filter balanced: ratio={self.params['ratio']!r} is invalid; allowed: a number >= 1")

    def select(self, workers, now):
        floor = min((load_of(w) for w in workers), default=0)
        return [
            w
            for w in workers
            if load_of(w) - floor <= self.params["slack"] or load_of(w) <= self.params["ratio"] * floor
        ]


FILTERS: dict[str, type[Filter]] = {cls.name: cls for cls in (Healthy, NotDraining, NotSaturated, Balanced)}


def make_filter(name: str, params: dict | None = None) -> Filter:
    if name not in FILTERS:
        raise ConfigError(f"unknown filter {name!r}; allowed: {', '.join(FILTERS)}")
    return FILTERS[name](params)
