"""Serving one OpenAI request: access checks, jobs, streaming or whole answers.

    access (401 / 429) -> model (404) -> prepare (400) -> admission gates (429; router/tenancy/admission.py)
    -> flow control (wait in the gateway's queue; 503 / 429; router/flow/, when enabled) -> dispatch

A streamed answer waits for its first increment before sending headers, so an error before the
first token (no worker: 503, a worker's 400) still gets its HTTP status; after that an error is
sent as a final `data: {"error": ...}` event. Either way the admission slot is released and
the workers' calls are cancelled when the response ends, fails or the client goes away; for a
whole (non-streamed) answer the gateway watches the connection and cancels on disconnect.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from splitserve.router import logctx
from splitserve.router.tenancy.access import ANONYMOUS, Authenticator, RateLimiter
from splitserve.router.tenancy.admission import AdmissionPipeline, Slots, Ticket
from splitserve.router.config import ApiKey
from splitserve.router.api.errors import APIError
from splitserve.router.flow import build_controller
from splitserve.router.flow.classify import classify
from splitserve.router.flow.fairness import FlowItem
from splitserve.router.api.prompts import Prepared, prepare_chat, prepare_completion
from splitserve.router.api.formatting import ChoiceState, Formatter, TokenText, sse, usage
from splitserve.router.tenancy.concurrency import Concurrency
from splitserve.router.tenancy.quota import Quota
from splitserve.router.tenancy.keyfile import check_scope
from splitserve.router.router import Router

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
_END = object()


class Gateway:
    def __init__(self, router: Router):
        self.router = router
        gateway = router.config.gateway
        self.auth = Authenticator(gateway.api_keys, gateway.api_keys_file)
        self.quota = Quota(router.metrics.registry, gateway.rate_limit_redis_url, router.config.index.key_prefix,
                           gateway.quota_window_s)
        self.limiter = RateLimiter(gateway, router.config.index.key_prefix)
        self.admission = AdmissionPipeline(Concurrency(gateway.max_concurrent_per_key), self.quota,
                                           Slots(gateway.max_concurrent_requests, gateway.max_queued_requests),
                                           router.metrics.rejected)
        self.tokens = TokenText(router.tokenizer)
        self.flow = build_controller(router.config.flow_control, router.pool, router.metrics.registry)

    async def access(self, request: Request) -> ApiKey:
        """FastAPI dependency of every /v1 route: API key, then its rate limit."""
        key = self.auth.check(request.headers.get("authorization"))
        try:
            await self.limiter.check(key)
        except APIError:
            self.router.metrics.rejected.labels(reason="rate_limit").inc()
            raise
        request.state.api_key = key
        return key

    def check_model(self, model: str) -> str | None:
        """The LoRA adapter `model` names (None: the base model); 404 for anything else."""
        names = self.router.config.served_model_names
        if model in names:
            return None
        adapters = self.router.adapters.names()
        if model in adapters:
            return model
        served = ", ".join([*names, *adapters])
        raise APIError(404, f"the model {model!r} does not exist; this server serves: {served}",
                       param="model", code="model_not_found")

    async def serve(self, request: Request, body, is_chat: bool) -> Response:
        lora_name = self.check_model(body.model)
        key = getattr(request.state, "api_key", ANONYMOUS)
        check_scope(key, body.model)
        request_id = logctx.request_id.get()
        # A client's X-Request-Id may repeat; the workers get it with a unique suffix.
        job_id = f"{request_id}-{uuid.uuid4().hex[:8]}" if request.state.is_client_request_id else request_id
        prepare = prepare_chat if is_chat else prepare_completion
        prepared = prepare(body, request_id, job_id, self.router.tokenizer, self.router.config.max_model_len,
                           **({"tool_call_parser": self.router.config.gateway.tool_call_parser} if is_chat else {}))
        if lora_name is not None:
            prepared.jobs[:] = [dataclasses.replace(job, lora_name=lora_name) for job in prepared.jobs]
        reserve = prepared.num_prompt_tokens + sum(job.params.max_tokens for job in prepared.jobs)
        ticket = await self.admission.admit(key, body.model, reserve)
        flow = None
        if body.priority:
            prepared.jobs[:] = [dataclasses.replace(job, priority=body.priority) for job in prepared.jobs]
        if self.flow is not None:
            try:
                flow = await self._wait_for_dispatch(request, key, body, request_id, reserve)
            except BaseException:
                await self.admission.release(ticket, None)
                raise
            if flow is None:
                log.info("client disconnected while its request was queued")
                await self.admission.release(ticket, None)
                return Response(status_code=499)
            prepared.jobs[:] = [dataclasses.replace(job, band=flow.band) for job in prepared.jobs]
        events = merged([self.router.dispatcher.generate(job) for job in prepared.jobs])
        formatter = Formatter(prepared, is_chat, self.tokens)
        cleanup = _Cleanup(events, self.admission, ticket, prepared, self.flow, flow)
        try:
            if prepared.stream:
                return await self._stream(prepared, formatter, events, cleanup)
            return await self._complete(request, prepared, formatter, events, cleanup)
        except BaseException:
            await cleanup()
            raise

    async def _wait_for_dispatch(self, request: Request, key: ApiKey, body, request_id: str,
                                 reserve: int) -> FlowItem | None:
        """Flow control: return the request's FlowItem once it may be dispatched (release it with
        the cleanup), None if the client left while it waited, or raise its 503 / 429."""
        cls = classify(self.flow.config, request.headers, body.model, key.name, key.priority, key.weight,
                       request.client.host if request.client else "")
        item = FlowItem(request_id, cls.band, cls.flow_id, reserve, cls.weight, body.priority)
        if self.flow.try_acquire(item):
            return item
        acquire = asyncio.ensure_future(self.flow.acquire(item))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({acquire, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not acquire.done():
                acquire.cancel()
            await asyncio.gather(acquire, gone, return_exceptions=True)
        if acquire.cancelled():
            return None
        acquire.result()
        return item

    async def _stream(self, prepared: Prepared, formatter: Formatter, events, cleanup) -> Response:
        t0 = time.monotonic()
        first = await events.__anext__()
        self.router.metrics.ttft.observe(time.monotonic() - t0)
        choices = cleanup.choices = [ChoiceState() for _ in prepared.jobs]

        async def body() -> AsyncIterator[bytes]:
            if formatter.is_chat:
                for index in range(len(choices)):
                    yield sse(formatter.chunk(index, None, role=True))
            try:
                item = first
                while item is not _END:
                    index, chunk = item
                    choices[index].add(chunk)
                    for data in formatter.stream(index, chunk, choices[index]):
                        yield sse(data)
                    item = await anext(events, _END)
                if prepared.include_usage:
                    yield sse(formatter.usage_chunk(choices))
            except APIError as exc:
                log.warning("stream failed after the first token: %s", exc.message)
                yield sse(exc.body())
            yield DONE

        return _CleanupStreamingResponse(body(), cleanup, media_type="text/event-stream",
                                         headers={**_worker_headers(first[1]), **cleanup.headers()})

    async def _complete(self, request: Request, prepared: Prepared, formatter: Formatter, events,
                        cleanup) -> Response:
        choices = cleanup.choices = [ChoiceState() for _ in prepared.jobs]

        async def collect():
            async for index, chunk in events:
                choices[index].add(chunk)

        task = asyncio.create_task(collect())
        disconnect = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            log.info("client disconnected; request aborted on the workers")
            await cleanup()
            return Response(status_code=499)
        await cleanup()
        task.result()   # raises the generation's APIError, if any
        last = next((c.last for c in choices if c.last is not None), None)
        return JSONResponse(formatter.complete(choices), headers={**_worker_headers(last), **cleanup.headers()})


async def merged(gens: list) -> AsyncIterator[tuple[int, object]]:
    """(choice index, chunk) from several generations as they come; closing this closes them all."""
    if len(gens) == 1:
        try:
            async for chunk in gens[0]:
                yield 0, chunk
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen) -> None:
        try:
            async for chunk in gen:
                await queue.put((index, chunk))
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


class _Cleanup:
    """Closes the generations and releases the request's admission ticket (its slot, its key's
    in-flight count, and its quota settled with the tokens the choices got: streamed so far, for a
    cut stream), once."""

    def __init__(self, events, admission: AdmissionPipeline, ticket: Ticket, prepared: Prepared,
                 flow=None, flow_item: FlowItem | None = None):
        self.events = events
        self.flow, self.flow_item = flow, flow_item
        self.admission = admission
        self.ticket = ticket
        self.prepared = prepared
        self.is_done = False
        self.choices: list[ChoiceState] = []

    def headers(self) -> dict[str, str]:
        return self.ticket.quota_headers

    async def __call__(self) -> None:
        if self.is_done:
            return
        self.is_done = True
        try:
            await self.events.aclose()
        finally:
            if self.flow_item is not None:
                ran = any(c.last is not None for c in self.choices)
                self.flow.release(self.flow_item, usage(self.prepared, self.choices)["total_tokens"] if ran else 0)
            await self.admission.release(self.ticket, (self.prepared, self.choices))


class _CleanupStreamingResponse(StreamingResponse):
    """Runs `cleanup` however the response ends, even if the client left before the first byte."""

    def __init__(self, content, cleanup: _Cleanup, **kwargs):
        super().__init__(content, **kwargs)
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.cleanup()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _worker_headers(chunk) -> dict[str, str]:
    if chunk is None:
        return {}
    headers = {"x-splitserve-decode-worker": chunk.decode_worker}
    if chunk.prefill_worker:
        headers["x-splitserve-prefill-worker"] = chunk.prefill_worker
    return headers
