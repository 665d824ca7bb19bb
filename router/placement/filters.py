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

    def __init__(self, params: dict | None = None, role: str = "decode"):
        self.params = parse_params(f"filter {self.name}", self.DEFAULTS, params or {})
        self.role = role  # the profile's: "decode" or "prefill"

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
    """A worker with `max_waiting` requests waiting is saturated; when every candidate is, the
    client gets 429. A full KV cache only steers: a worker whose KV use reaches `max_kv_usage` is
    dropped while another candidate has room, and when every cache is full the request joins the
    workers' own queues, as it would on one vLLM server, whose scheduler admits it when a running
    request ends. Refusing it instead turned a burst that filled both caches of a two-worker
    pool, with nothing waiting on either, into a 429 (docs/benchmarks/sweep.md).

    The prefill profile keeps the strict rule: a prefill worker with a full cache is passed
    over, and when every one is, the decode worker prefills the request itself, which refuses
    nobody."""

    name = "not-saturated"
    DEFAULTS = {"max_waiting": 64, "max_kv_usage": 0.99}
    empty_status = 429
    empty_reason = "every worker is saturated"

    def select(self, workers, now):
        queueing = [w for w in workers if w.load is None or w.load.num_waiting < self.params["max_waiting"]]
        roomy = [w for w in queueing if w.load is None or w.load.kv_usage < self.params["max_kv_usage"]]
        return roomy if self.role == "prefill" else roomy or queueing


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
    tree with the same two thresholds (balance_abs_threshold 64, balance_rel_threshold 1.5).
    Never leaves nobody: the least loaded worker always passes.

    The slack (16) is twice queue-depth's saturation point: below it the scorers weigh a queue
    against a prefix hit themselves, and the filter only stops a runaway. A slack of 4 moved a
    group's request off its worker at every burst; the move costs a miss there (about six
    hits' compute on a CPU host) and evicts another group's prefix, which turned a burst into a
    cascade: three shared-prefix traces at 5 req/s kept 57-74 % prefix hits with it, 70-84 %
    without the filter (docs/router.md, "Why a slack of 16")."""

    name = "balanced"
    DEFAULTS = {"slack": 16, "ratio": 1.5}

    def __init__(self, params: dict | None = None, role: str = "decode"):
        super().__init__(params, role)
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


def make_filter(name: str, params: dict | None = None, role: str = "decode") -> Filter:
    if name not in FILTERS:
        raise ConfigError(f"unknown filter {name!r}; allowed: {', '.join(FILTERS)}")
    return FILTERS[name](params, role)
