"""One request's way through the gateway: admission, then placement and dispatch per choice, then
release. Every OpenAI endpoint (chat, completions, embeddings, the Responses API) runs this one
path and formats what it yields.

    Pipeline.open(key, model, prepared)
        admit      the admission gates (tenancy/admission.py): key concurrency, quota, server slot
        dispatch   one Dispatcher.generate per job (core/dispatch.py: place, Generate, retry, resume)
    -> Run: async iteration yields ChoiceChunk(index, chunk) as the choices' workers send them,
       each already added to run.choices[index]
    Run.close()   closes the generations (the workers abort what still runs) and releases the
                  admission ticket with the request's Usage, once, however the request ended

The stages are methods of their own so a stage can be wrapped or inserted without touching the
others: a flow-control queue goes between `_admit` and `_dispatch`; tracing wraps each of them;
a process that serves a single local decode worker builds a Pipeline over a Dispatcher whose
pool holds only that worker.

Ownership: the Run owns its ticket and its generations; whoever opened it must close it
(`async with run`, or `await run.close()` from a response's cleanup). A Run that is never
iterated still releases everything on close.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import NamedTuple

from splitserve.platform import tracing
from splitserve.router.api.prompts import Prepared
from splitserve.router.config import ApiKey
from splitserve.router.core.dispatch import Chunk, Dispatcher
from splitserve.router.core.usage import ChoiceState, Usage, count_usage
from splitserve.router.tenancy.admission import AdmissionPipeline, Ticket

_END = object()


class ChoiceChunk(NamedTuple):
    index: int      # the choice (job) it belongs to
    chunk: Chunk


class Pipeline:
    def __init__(self, admission: AdmissionPipeline, dispatcher: Dispatcher):
        self.admission = admission
        self.dispatcher = dispatcher

    async def open(self, key: ApiKey, model: str, prepared: Prepared, *, bills_completion: bool = True,
                   num_slots: int = 1) -> Run:
        """Admit the request and start its generations; raises the admission's APIError (429)
        with nothing held. The quota holds the prompt plus every choice's max_tokens until the
        request ends; bills_completion=False (embeddings) reserves and bills the prompt only.
        `num_slots`: the server slots it takes (embeddings: one per input, so 2,048 inputs weigh as
        2,048 requests)."""
        reserve_tokens = prepared.num_prompt_tokens
        if bills_completion:
            reserve_tokens += sum(job.params.max_tokens for job in prepared.jobs)
        ticket = await self._admit(key, model, reserve_tokens, num_slots)
        return Run(prepared, ticket, self.admission, self._dispatch(prepared), bills_completion=bills_completion)

    async def _admit(self, key: ApiKey, model: str, reserve_tokens: int, num_slots: int) -> Ticket:
        with tracing.current().child("gateway.admission") as span:
            return await self.admission.admit(key, model, reserve_tokens, num_slots=num_slots, span=span)

    def _dispatch(self, prepared: Prepared) -> AsyncIterator[ChoiceChunk]:
        return merged([self.dispatcher.generate(job) for job in prepared.jobs])


class Run:
    """One admitted request in flight: iterate it for its chunks, close it once it is over."""

    def __init__(self, prepared: Prepared, ticket: Ticket, admission: AdmissionPipeline,
                 events: AsyncIterator[ChoiceChunk], *, bills_completion: bool = True):
        self.prepared = prepared
        self.ticket = ticket
        self.choices = [ChoiceState() for _ in prepared.jobs]
        is_prompt_only = prepared.echo is not None and prepared.echo.is_prompt_only
        self.counts_completion = bills_completion and not is_prompt_only
        self._admission = admission
        self._events = events
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
        """Cancel what still runs on the workers, then release the admission ticket with the usage
        so far (a cut stream is billed for what it got). Later calls do nothing."""
        if self.is_closed:
            return
        self.is_closed = True
        try:
            await self._events.aclose()
        finally:
            await self._admission.release(self.ticket, self.usage() if self.has_output else None)

    async def __aenter__(self) -> Run:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def merged(gens: list) -> AsyncIterator[ChoiceChunk]:
    """ChoiceChunks from several generations as they come; closing this closes them all."""
    if len(gens) == 1:
        try:
            async for chunk in gens[0]:
                yield ChoiceChunk(0, chunk)
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen) -> None:
        try:
            async for chunk in gen:
                await queue.put(ChoiceChunk(index, chunk))
            await queue.put(_END)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put(exc)
        finally:
            await gen.aclose()

    tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
