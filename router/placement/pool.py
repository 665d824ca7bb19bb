"""The workers the router knows, and what it knows about each.

`WorkerPool` is the single writer of every `WorkerState`: the event watchers report what a
worker says about itself (`on_info`, `on_load`, `on_disconnect`), the dispatcher reports
failures and the life of each assignment (`assign` -> `first_token` -> `finish`), discovery adds
and removes addresses. Placement only reads. A worker is *healthy* while its WatchEvents stream
is connected, it serves the router's model with the router's block size, and no recent call to
it failed (a failure holds it out for a backoff that doubles per consecutive failure).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from splitserve.platform.wire import worker_pb2 as pb

log = logging.getLogger(__name__)

DECODE_ROLES = ("decode", "both")
PREFILL_ROLES = ("prefill", "both")


@dataclass
class WorkerState:
    address: str
    role: str = ""  # from WorkerInfo; "" until the worker said
    worker_id: str = ""
    kv_address: str = ""
    num_total_blocks: int = 0
    is_connected: bool = False
    incompatible: str = ""  # why this worker cannot serve the router's model
    load: pb.LoadReport | None = None
    load_time: float = 0.0
    down_until: float = 0.0
    num_failures: int = 0
    num_pending: int = 0  # assigned by this router, first token not yet seen
    num_pending_prefill_tokens: int = 0
    num_inflight: int = 0  # assigned by this router, not finished

    def is_healthy(self, now: float) -> bool:
        return self.is_connected and not self.incompatible and now >= self.down_until

    @property
    def can_decode(self) -> bool:
        return self.role in DECODE_ROLES

    @property
    def can_prefill(self) -> bool:
        return self.role in PREFILL_ROLES


@dataclass
class Assignment:
    """One attempt of one request on a decode worker (and maybe a prefill worker)."""

    decode: str
    prefill: str = ""
    num_prefill_tokens: int = 0
    is_pending: bool = True
    is_finished: bool = False


@dataclass
class WorkerPool:
    model_id: str
    block_size: int
    clock: callable = time.monotonic
    failure_backoff_s: float = 1.0
    failure_backoff_max_s: float = 10.0
    workers: dict[str, WorkerState] = field(default_factory=dict)

    # -- discovery ----------------------------------------------------------------------------
    def add(self, address: str) -> WorkerState:
        state = self.workers.get(address)
        if state is None:
            state = self.workers[address] = WorkerState(address)
        return state

    def remove(self, address: str) -> None:
        self.workers.pop(address, None)

    # -- what workers say ---------------------------------------------------------------------
    def on_info(self, address: str, info: pb.WorkerInfo) -> bool:
        """A (re)connected worker introduced itself; True if it is a new process (empty cache)."""
        state = self.add(address)
        is_new = state.worker_id != info.worker_id
        state.role, state.worker_id, state.kv_address = info.role, info.worker_id, info.kv_address
        state.num_total_blocks = info.num_total_blocks
        state.incompatible = self._incompatibility(info)
        if state.incompatible:
            log.error("worker %s is left out: %s", address, state.incompatible)
        state.is_connected = True
        state.load = None
        return is_new

    def _incompatibility(self, info: pb.WorkerInfo) -> str:
        if info.model_id != self.model_id:
            return f"it serves model {info.model_id!r}, the router routes {self.model_id!r}"
        if info.layout.block_size != self.block_size:
            return f"its block size is {info.layout.block_size}, the router hashes blocks of {self.block_size}"
        return ""

    def on_load(self, address: str, load: pb.LoadReport) -> None:
        state = self.workers.get(address)
        if state is not None:
            state.load, state.load_time = load, self.clock()

    def on_disconnect(self, address: str, reason: str) -> None:
        state = self.workers.get(address)
        if state is not None and state.is_connected:
            log.warning("worker %s is down: %s", address, reason)
            state.is_connected = False
            state.load = None

    # -- what calls to workers show -------------------------------------------------------------
    def report_failure(self, address: str, reason: str) -> None:
        state = self.workers.get(address)
        if state is None:
            return
        state.num_failures += 1
        hold = min(self.failure_backoff_s * 2 ** (state.num_failures - 1), self.failure_backoff_max_s)
        state.down_until = self.clock() + hold
        log.warning("worker %s failed (%s); held out for %.1f s", address, reason, hold)

    def report_success(self, address: str) -> None:
        state = self.workers.get(address)
        if state is not None:
            state.num_failures = 0

    def assign(self, decode: str, prefill: str = "", num_prefill_tokens: int = 0) -> Assignment:
        a = Assignment(decode, prefill, num_prefill_tokens)
        for state, tokens in self._targets(a):
            state.num_pending += 1
            state.num_inflight += 1
            state.num_pending_prefill_tokens += tokens
        return a

    def first_token(self, a: Assignment) -> None:
        if not a.is_pending:
            return
        a.is_pending = False
        self._adjust(a, pending=-1, inflight=0)

    def finish(self, a: Assignment) -> None:
        if a.is_finished:
            return
        self.first_token(a)
        a.is_finished = True
        self._adjust(a, pending=0, inflight=-1)

    def _adjust(self, a: Assignment, pending: int, inflight: int) -> None:
        for state, tokens in self._targets(a):
            state.num_pending = max(0, state.num_pending + pending)
            state.num_inflight = max(0, state.num_inflight + inflight)
            if pending:
                state.num_pending_prefill_tokens = max(0, state.num_pending_prefill_tokens - tokens)

    def _targets(self, a: Assignment) -> list[tuple[WorkerState, int]]:
        """The assignment's workers still in the pool, with the prompt tokens each computes."""
        pairs = [(a.decode, 0 if a.prefill else a.num_prefill_tokens), (a.prefill, a.num_prefill_tokens)]
        return [(self.workers[address], tokens) for address, tokens in pairs if address in self.workers]

    # -- reading -------------------------------------------------------------------------------
    def decode_workers(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.can_decode]

    def prefill_workers(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.can_prefill]

    def num_healthy(self, role_ok=lambda w: w.can_decode) -> int:
        now = self.clock()
        return sum(1 for w in self.workers.values() if role_ok(w) and w.is_healthy(now))
