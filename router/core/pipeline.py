"""One request's way through the gateway: admission, then placement and dispatch per choice, then
release. Every OpenAI endpoint (chat, completions, embeddings, the Responses API) runs this one
path and formats what it yields.

    Pipeline.open(key, model, prepared, origin)
        queue      flow control (router/flow/, when enabled and the request has an origin): classify
                   by key (band, flow), then wait in the gateway's queue by band and flow while the
                   workers are saturated (503 / 429)
        admit      the admission gates (tenancy/admission.py): key concurrency, quota, server slot
                   (the slot queue ordered by band)
        dispatch   one Dispatcher.generate per job (core/dispatch.py: place, Generate, retry, resume)

Flow control comes first so that a queued request holds nothing: no server slot and no quota
reservation that a request of a higher band would wait behind. The body priority of every job is
clamped to the key's range before either (router/flow/classify.py's clamp_priority).
    -> Run: async iteration yields ChoiceChunk(index, chunk) as the choices' workers send them,
       each already added to run.choices[index]
    Run.close()   closes the generations (the workers abort what still runs), settles the flow
                  item to the tokens used and releases the admission ticket with the request's
                  Usage, once, however the request ended

The stages are methods of their own so a stage can be wrapped or inserted without touching the
others: the flow-control queue sits before `_admit`; tracing wraps each of them;
a process that serves a single local decode worker builds a Pipeline over a Dispatcher whose
pool holds only that worker.

Ownership: the Run owns its ticket and its generations; whoever opened it must close it
(`async with run`, or `await run.close()` from a response's cleanup). A Run that is never
iterated still releases everything on close.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import NamedTuple

from splitserve.platform.observability import tracing
from splitserve.router.config import ApiKey
from splitserve.router.core.choices import ChoiceState, count_usage
from splitserve.router.core.dispatch import Dispatcher
from splitserve.router.core.prepared import Prepared
from splitserve.router.core.streams import ChoiceChunk, merged, unless_gone
from splitserve.router.errors import APIError
from splitserve.router.flow.classify import clamp_priority, classify
from splitserve.router.flow.controller import FlowController
from splitserve.router.flow.fairness import FlowItem
from splitserve.router.tenancy.access import key_label
from splitserve.router.tenancy.admission import AdmissionPipeline, Ticket
from splitserve.router.tenancy.prefix_owners import PrefixOwners
from splitserve.router.usage import Usage

log = logging.getLogger(__name__)


class Origin(NamedTuple):
    """Where a request came from, as flow control reads it: the headers (objective, fairness id),
    the client's address, and an awaitable that returns once the client has disconnected."""

    headers: Mapping[str, str]
    client: str
    disconnected: Callable[[], Awaitable[None]]


class Pipeline:
    def __init__(
        self,
        admission: AdmissionPipeline,
        dispatcher: Dispatcher,
        flow: FlowController | None = None,
        owners: PrefixOwners | None = None,
    ):
        self.admission = admission
        self.dispatcher = dispatcher
        self.flow = flow  # None: flow control is off, every admitted request is dispatched at once
        self.owners = owners  # None: cached_tokens reported as the workers say (no tenants to tell apart)

    async def open(
        self,
        key: ApiKey,
        model: str,
        prepared: Prepared,
        *,
        bills_completion: bool = True,
        num_slots: int = 1,
        origin: Origin | None = None,
    ) -> Run:
        """Admit the request and start its generations; raises the admission's APIError (429)
        with nothing held. The quota holds the prompt plus every choice's max_tokens until the
        request ends; bills_completion=False (embeddings) reserves and bills the prompt only.
        `num_slots`: the server slots it takes (embeddings: one per input, so 2,048 inputs weigh as
        2,048 requests). With flow control on, a request with an `origin` first waits for its turn
        (flow control's 400 / 429 / 503, or 499 when its client leaves the queue); a refusal of
        admission after that gives the flow item back."""
        reserve_tokens = prepared.num_prompt_tokens
        if bills_completion:
            reserve_tokens += sum(job.params.max_tokens for job in prepared.jobs)
        clamp_priorities(prepared, key)
        item = None
        if self.flow is not None and origin is not None:
            item = await self._queue(key, model, prepared, reserve_tokens, origin)
            prepared.jobs[:] = [dataclasses.replace(job, band=item.band) for job in prepared.jobs]
        try:
            ticket = await self._admit(key, model, reserve_tokens, num_slots, item.band if item else 0)
        except BaseException:
            if item is not None:
                self.flow.release(item, 0)
            raise
        return Run(
            prepared,
            ticket,
            self.admission,
            self._dispatch(prepared),
            bills_completion=bills_completion,
            flow=self.flow,
            flow_item=item,
            cached_caps=self._cached_caps(key, prepared),
        )

    def _cached_caps(self, key: ApiKey, prepared: Prepared) -> list[int] | None:
        """Per job, the cached_tokens the key may be told: the prefix it sent before
        (router/tenancy/prefix_owners.py); None without tenants."""
        if self.owners is None:
            return None
        tenant = key_label(key)
        hashes = [self.dispatcher.hasher.hash_blocks(job.prompt_token_ids) for job in prepared.jobs]
        caps = [self.owners.owned_tokens(tenant, h) for h in hashes]
        for h in hashes:
            self.owners.record(tenant, h)
        return caps

    async def _admit(self, key: ApiKey, model: str, reserve_tokens: int, num_slots: int, band: int) -> Ticket:
        with tracing.current().child("gateway.admission") as span:
            return await self.admission.admit(key, model, reserve_tokens, num_slots=num_slots, band=band, span=span)

    async def _queue(
        self, key: ApiKey, model: str, prepared: Prepared, reserve_tokens: int, origin: Origin
    ) -> FlowItem:
        """The request's FlowItem once it may be dispatched (Run.close releases it); raises flow
        control's APIError (400 unknown objective, 429 over its share, 503 saturated), or a 499
        if the client disconnects while it waits (it leaves the queue at once)."""
        cls = classify(self.flow.config, origin.headers, model, key, origin.client)
        priority = prepared.jobs[0].priority if prepared.jobs else 0
        item = FlowItem(
            prepared.request_id,
            cls.band,
            cls.flow_id,
            reserve_tokens,
            cls.weight,
            priority,
            sub_flow=cls.sub_flow,
            label=cls.tenant_label,
        )
        with tracing.current().child(
            "gateway.flow",
            attributes={
                "splitserve.flow.band": cls.band,
                "splitserve.flow.id": cls.flow_id,
                **({"splitserve.flow.sub_flow": cls.sub_flow} if cls.sub_flow else {}),
            },
        ) as span:
            if self.flow.try_acquire(item):
                span.set("splitserve.flow.queued", False)
                return item
            span.set("splitserve.flow.queued", True)
            acquire = await unless_gone(self.flow.acquire(item), origin.disconnected())
            if acquire.cancelled():
                log.info("client disconnected while its request was queued")
                raise APIError(
                    499, "the client closed the connection while its request was queued", code="client_closed"
                )
            acquire.result()
            return item

    def _dispatch(self, prepared: Prepared) -> AsyncIterator[ChoiceChunk]:
        return merged([self.dispatcher.generate(job) for job in prepared.jobs])


class Run:
    """One admitted request in flight: iterate it for its chunks, close it once it is over."""

    def __init__(
        self,
        prepared: Prepared,
        ticket: Ticket,
        admission: AdmissionPipeline,
        events: AsyncIterator[ChoiceChunk],
        *,
        bills_completion: bool = True,
        flow: FlowController | None = None,
        flow_item: FlowItem | None = None,
        cached_caps: list[int] | None = None,
    ):
        self.prepared = prepared
        self.ticket = ticket
        self.choices = [ChoiceState() for _ in prepared.jobs]
        is_prompt_only = prepared.echo is not None and prepared.echo.is_prompt_only
        self.counts_completion = bills_completion and not is_prompt_only
        self._admission = admission
        self._events = events
        self._flow, self._flow_item = flow, flow_item
        self._cached_caps = cached_caps  # per choice: the most cached_tokens its key may see
        self.is_closed = False

    @property
    def quota_headers(self) -> dict[str, str]:
        """The key's x-ratelimit-* headers: as admitted, and after close() as settled."""
        return self.ticket.quota_headers

    def __aiter__(self) -> Run:
        return self

    async def __anext__(self) -> ChoiceChunk:
        item = await self.next()
        if item is None:
            raise StopAsyncIteration
        return item

    async def next(self) -> ChoiceChunk | None:
        """The next chunk (already added to its choice), or None once every choice has finished."""
        item = await anext(self._events, None)
        if item is not None:
            if self._cached_caps is not None:
                chunk, cap = item.chunk, self._cached_caps[item.index]
                chunk.num_cached_tokens = min(chunk.num_cached_tokens, cap)
                # a pulled prefix was cached too, on another worker: the same bound for both
                chunk.num_pulled_tokens = min(chunk.num_pulled_tokens, cap - chunk.num_cached_tokens)
            self.choices[item.index].add(item.chunk)
        return item

    @property
    def has_output(self) -> bool:
        """Some choice got a chunk (a request that got nothing is released, not billed)."""
        return any(c.last is not None for c in self.choices)

    def usage(self) -> Usage:
        """What the request used so far (all of it once every choice has finished)."""
        return count_usage(self.prepared.num_prompt_tokens, self.choices, counts_completion=self.counts_completion)

    async def close(self) -> None:
        """Cancel what still runs on the workers, then settle the flow item to the tokens used and
        release the admission ticket with the usage so far (a cut stream is billed for what it
        got). Later calls do nothing."""
        if self.is_closed:
            return
        self.is_closed = True
        try:
            await self._events.aclose()
        finally:
            usage = self.usage() if self.has_output else None
            if self._flow_item is not None:
                self._flow.release(self._flow_item, usage.total_tokens if usage is not None else 0)
            await self._admission.release(self.ticket, usage)

    async def __aenter__(self) -> Run:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def clamp_priorities(prepared: Prepared, key: ApiKey) -> None:
    """Every job's body priority raised to the key's floor (the engine orders a band by it)."""
    if any(job.priority < key.min_request_priority for job in prepared.jobs):
        prepared.jobs[:] = [
            dataclasses.replace(job, priority=clamp_priority(job.priority, key)) for job in prepared.jobs
        ]
