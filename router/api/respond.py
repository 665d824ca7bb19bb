"""An open run written as an HTTP response: a stream of events, or one JSON answer.

A streamed answer waits for its first increment before sending headers, so an error before the
first token (no worker: 503, a worker's 400) still gets its HTTP status; after that an error is
sent as the endpoint's error event. Either way the run is closed (its admission released, the
workers' calls cancelled) when the response ends, fails or the client goes away; for a whole
(non-streamed) answer the connection is watched and the run cancelled on disconnect (499).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from splitserve.router.core.job import Chunk
from splitserve.router.core.pipeline import ChoiceChunk, Run, unless_gone
from splitserve.router.errors import APIError

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


class StreamEvents(Protocol):
    """How an endpoint writes a stream: called by `respond`, in this order."""

    def start(self, run: Run) -> list[bytes]: ...

    def chunk(self, run: Run, item: ChoiceChunk) -> list[bytes]: ...

    def end(self, run: Run) -> list[bytes]: ...

    def error(self, run: Run, exc: APIError) -> list[bytes]: ...


async def respond(
    request: Request, run: Run, events: StreamEvents, answer: Callable[[Run], dict], ttft=None
) -> Response:
    """The HTTP response of an open run: `events` write a stream, `answer` the whole JSON body
    once every choice has finished; `ttft` (a histogram) observes a stream's first increment.
    The run is closed however this ends."""
    try:
        if run.prepared.stream:
            return await _stream(run, events, ttft)
        if not await _collect(request, run):
            return Response(status_code=499)
        last = next((c.last for c in run.choices if c.last is not None), None)
        return JSONResponse(answer(run), headers={**_worker_headers(last), **run.quota_headers})
    except BaseException:
        await run.close()
        raise


async def wait_disconnect(request: Request) -> None:
    """Returns when the client has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _stream(run: Run, events: StreamEvents, ttft) -> Response:
    t0 = time.monotonic()
    first = await run.next()
    if ttft is not None:
        ttft.observe(time.monotonic() - t0)

    async def body() -> AsyncIterator[bytes]:
        for data in events.start(run):
            yield data
        try:
            item = first
            while item is not None:
                for data in events.chunk(run, item):
                    yield data
                item = await run.next()
            out = events.end(run)
        except APIError as exc:
            log.warning("stream failed after the first token: %s", exc.message)
            out = events.error(run, exc)
        for data in out:
            yield data

    return ClosingStreamingResponse(
        body(),
        run.close,
        media_type="text/event-stream",
        headers={**_worker_headers(first.chunk if first else None), **run.quota_headers},
    )


async def _collect(request: Request, run: Run) -> bool:
    """Every chunk of the run; False if the client went away first (the run is then closed).
    Closes the run and raises the generation's APIError, if any."""

    async def collect():
        async for _ in run:
            pass

    task = await unless_gone(collect(), wait_disconnect(request))
    if task.cancelled():
        log.info("client disconnected; request aborted on the workers")
        await run.close()
        return False
    await run.close()
    task.result()
    return True


class ClosingStreamingResponse(StreamingResponse):
    """Runs `on_close` however the response ends, even if the client left before the first byte."""

    def __init__(self, content, on_close: Callable[[], Awaitable[None]], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def _worker_headers(chunk: Chunk | None) -> dict[str, str]:
    if chunk is None:
        return {}
    headers = {"x-splitserve-decode-worker": chunk.decode_worker}
    if chunk.prefill_worker:
        headers["x-splitserve-prefill-worker"] = chunk.prefill_worker
    if chunk.num_pulled_tokens:
        headers["x-splitserve-pulled-tokens"] = str(chunk.num_pulled_tokens)
    return headers
