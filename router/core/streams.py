"""Two stream helpers of the request pipeline (router/core/pipeline.py): the choices'
generations merged into one stream of ChoiceChunks, and work that stops when its client leaves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import NamedTuple

from splitserve.router.core.job import Chunk

_END = object()


class ChoiceChunk(NamedTuple):
    index: int  # the choice (job) it belongs to
    chunk: Chunk


async def unless_gone(work: Awaitable, gone: Awaitable) -> asyncio.Future:
    """Run `work` until it ends or `gone` (the client's disconnect) does, whichever comes first.
    Returns the work's task: done (its result or error inside), or cancelled if the client left
    first. Neither is left running, however this returns."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone)
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # The watcher only waits on the connection: cancelled, it ends at the loop's next turn,
        # and waiting for that would add a turn to every request's latency.
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task


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
