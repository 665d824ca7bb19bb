"""Admission: the ordered gates a generation request passes before it reaches a worker, and the
one path that gives back what they took.

    authenticate (401) -> rate limit (429)              every /v1 route, in Gateway.access
    scope (404) -> prepare (400)                        per request, nothing held
    key concurrency (429) -> quota (429) -> slot (429)  AdmissionPipeline below: each holds something

A gate of the pipeline holds something once entered (a per-key in-flight count, a token
reservation, a server slot), so `AdmissionPipeline.admit` enters them in order and, when one
refuses, leaves the ones already entered in reverse order before the refusal reaches the client;
`Ticket.release` leaves them all, once, when the request ends however it ends (the pipeline's Run
calls it when it closes). The refusal is counted in `splitserve_router_rejected_requests{reason}`
with the gate's reason.

Two per-key limits with distinct jobs (docs/router.md):
- the rate limit (access.RateLimiter) smooths bursts: a token bucket in requests per second,
  set for every caller (anonymous included) on the gateway config or per `--api-key`;
- the quota (tenancy/quota.py) is a tenant's contract from the key file: requests and tokens per
  window and tokens per month, reserved at admission and settled to the tokens actually used.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Protocol

from splitserve.platform.observability.tracing import NOOP
from splitserve.router.config import ApiKey
from splitserve.router.errors import APIError
from splitserve.router.tenancy.concurrency import Concurrency
from splitserve.router.tenancy.quota import Grant, Quota
from splitserve.router.usage import Usage


class Slots:
    """Bounded concurrency with a bounded wait queue (one instance per gateway): at most
    `max_concurrent` slots are held, `max_queued` more requests wait, beyond that 429.

    Waiters are served by band (the request's flow-control band, higher first), then in arrival
    order, so a high band is never queued behind a lower one. The head waits for all the slots it
    asks for (an embeddings request: one per input) and nobody passes it: two multi-slot takers
    cannot each hold half and wait forever."""

    def __init__(self, max_concurrent: int, max_queued: int):
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.num_running = 0  # slots held
        self._waiters: list[tuple[int, int, int, asyncio.Future]] = []  # heap of (-band, seq, num_slots, future)
        self._seq = itertools.count()

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    def _fits(self, num_slots: int) -> bool:
        return self.num_running + num_slots <= self.max_concurrent

    async def acquire(self, num_slots: int = 1, band: int = 0) -> int:
        """Take `num_slots` slots (at most max_concurrent); returns how many were taken, for release()."""
        num_slots = max(1, min(num_slots, self.max_concurrent))
        if not self._waiters and self._fits(num_slots):
            self.num_running += num_slots
            return num_slots
        if len(self._waiters) >= self.max_queued:
            raise APIError(
                429,
                f"the server is at capacity ({self.num_running} requests running, "
                f"{self.num_queued} queued); retry shortly",
                code="queue_full",
                retry_after_s=1,
            )
        entry = (-band, next(self._seq), num_slots, asyncio.get_running_loop().create_future())
        heapq.heappush(self._waiters, entry)
        try:
            await entry[3]
        except BaseException:
            if entry[3].done() and not entry[3].cancelled():
                self.release(num_slots)  # granted as its caller left: give the slots back
            else:
                self._waiters.remove(entry)
                heapq.heapify(self._waiters)
                self._wake()
            raise
        return num_slots

    def release(self, num_slots: int = 1) -> None:
        self.num_running -= num_slots
        assert self.num_running >= 0
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][2]):
            _, _, num_slots, future = heapq.heappop(self._waiters)
            self.num_running += num_slots
            future.set_result(None)


@dataclass
class Ticket:
    """One request's passage through the gates: what it asked for and what each gate holds."""

    key: ApiKey
    model: str
    reserve_tokens: int  # prompt tokens + max_tokens of every choice
    counted: bool = False  # the key-concurrency gate counted it
    grant: Grant | None = None  # the quota gate's reservation
    has_slot: bool = False
    num_slots: int = 1  # slots asked for (an embeddings request: one per input)
    band: int = 0  # its flow-control band: the slot queue serves higher bands first
    entered: list[Gate] = field(default_factory=list)

    @property
    def quota_headers(self) -> dict[str, str]:
        return self.grant.headers if self.grant is not None else {}


class Gate(Protocol):
    reason: str  # the `reason` label of a refusal

    async def enter(self, ticket: Ticket) -> None:
        """Take what the request needs, or raise APIError (having taken nothing)."""

    async def leave(self, ticket: Ticket, usage: Usage | None) -> None:
        """Give back what enter took. `usage`: what the request used, or None if it got nothing."""


class KeyConcurrencyGate:
    reason = "key_concurrency"

    def __init__(self, concurrency: Concurrency):
        self.concurrency = concurrency

    async def enter(self, ticket: Ticket) -> None:
        ticket.counted = self.concurrency.enter(ticket.key)

    async def leave(self, ticket: Ticket, usage: Usage | None) -> None:
        if ticket.counted:
            self.concurrency.leave(ticket.key)


class QuotaGate:
    reason = "token_limit"
    name = "quota"  # its span: admission.quota

    def __init__(self, quota: Quota):
        self.quota = quota

    async def enter(self, ticket: Ticket) -> None:
        ticket.grant = await self.quota.admit(ticket.key, ticket.model, ticket.reserve_tokens)

    async def leave(self, ticket: Ticket, usage: Usage | None) -> None:
        if usage is None:
            await self.quota.release(ticket.grant)
        else:
            await self.quota.settle(ticket.grant, usage)


class SlotGate:
    reason = "queue_full"
    name = "slot"  # its span, admission.slot: the time queued for a slot

    def __init__(self, slots: Slots):
        self.slots = slots

    async def enter(self, ticket: Ticket) -> None:
        ticket.num_slots = await self.slots.acquire(ticket.num_slots, band=ticket.band)
        ticket.has_slot = True

    async def leave(self, ticket: Ticket, usage: Usage | None) -> None:
        if ticket.has_slot:
            ticket.has_slot = False
            self.slots.release(ticket.num_slots)


class AdmissionPipeline:
    def __init__(self, concurrency: Concurrency, quota: Quota, slots: Slots, rejected):
        self.slots = slots
        self.gates: tuple[Gate, ...] = (KeyConcurrencyGate(concurrency), QuotaGate(quota), SlotGate(slots))
        self.rejected = rejected  # the Counter of refusals, labelled by reason

    @property
    def num_running(self) -> int:
        """Requests holding a server slot."""
        return self.slots.num_running

    @property
    def num_queued(self) -> int:
        """Requests waiting for a server slot."""
        return self.slots.num_queued

    async def admit(
        self, key: ApiKey, model: str, reserve_tokens: int, *, num_slots: int = 1, band: int = 0, span=NOOP
    ) -> Ticket:
        """Pass every gate in order, or raise the first refusal with nothing left held. `num_slots`:
        concurrency slots the request takes (work in proportion, e.g. one per embeddings input);
        `band`: its flow-control band (the slot queue's order).
        `span`: the request's admission span; each gate is a child (the slot gate's is the queue time)."""
        ticket = Ticket(key, model, reserve_tokens, num_slots=num_slots, band=band)
        for gate in self.gates:
            try:
                with span.child(f"admission.{getattr(gate, 'name', gate.reason)}"):
                    await gate.enter(ticket)
            except BaseException as exc:  # a refusal, or the client gone while it waited for a slot
                if isinstance(exc, APIError) and exc.status == 429:
                    self.rejected.labels(reason=gate.reason).inc()
                await self.release(ticket, None)
                raise
            ticket.entered.append(gate)
        return ticket

    async def release(self, ticket: Ticket, usage: Usage | None) -> None:
        """Leave every gate the ticket entered, in reverse order, once (later calls do nothing).
        `usage`: what a request that got output used (the pipeline's Run counts it), or None."""
        entered, ticket.entered = ticket.entered, []
        for gate in reversed(entered):
            await gate.leave(ticket, usage)
