"""One attempt of a generation on one decode worker: the Generate call, its stream turned into
`Chunk`s, and the calls in flight per worker, so a worker marked down fails its calls over.

An attempt fails with `WorkerLost` (the dispatcher then retries or resumes elsewhere) on a gRPC
error other than INVALID_ARGUMENT, a stream that ends without a finish reason or with ABORT, or
its worker being marked down (`worker_down` cancels the call). INVALID_ARGUMENT is the caller's:
APIError(400), with the API field the worker's message names. Closing the stream cancels the call:
the worker aborts the request and frees its blocks (and the prefill worker's).

`on_step(worker, seconds)`, when set (flow control's latency caps, router/flow/latency.py), hears
the time per token between two messages of one stream: the worker's step time as the router sees it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

import grpc

from splitserve.platform.observability import tracing
from splitserve.platform.tokenizer import Tokenizer
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router import logctx
from splitserve.router.core.job import Chunk, Job, Progress, WorkerLost
from splitserve.router.core.worker_messages import generate_request
from splitserve.router.errors import APIError
from splitserve.router.placement.placer import Decision, Placer
from splitserve.router.placement.pool import WorkerPool

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


class WorkerCalls:
    def __init__(self, pool: WorkerPool, placer: Placer, tokenizer: Tokenizer | None, channels, metrics=None):
        self.pool = pool
        self.placer = placer
        self.tokenizer = tokenizer
        self.channels = channels
        self.metrics = metrics
        self._calls: dict[str, dict[int, grpc.aio.Call]] = {}  # worker -> in-flight calls
        self._lost: set[int] = set()  # ids of calls cancelled by worker_down
        self.on_step: Callable | None = None  # (WorkerState, seconds per token) after each message but the first

    @property
    def num_open(self) -> int:
        return sum(len(calls) for calls in self._calls.values())

    def worker_down(self, address: str) -> None:
        for key, call in list(self._calls.get(address, {}).items()):
            self._lost.add(key)
            call.cancel()

    async def attempt(self, job: Job, decision: Decision, progress: Progress) -> AsyncIterator[Chunk]:
        """Run `job` on `decision`'s workers from `progress` (a resume when it holds tokens)."""
        params = without_prompt_scoring(job.params) if progress.token_ids else job.params
        request = generate_request(
            job.request_id,
            job.prompt_token_ids,
            params,
            decision,
            self.placer.config.disaggregation,
            resume_output_token_ids=progress.token_ids,
            lora_name=job.lora_name,
            priority=job.priority,
            band=job.band,
        )
        prefill = request.prefill_workers[0] if request.prefill_workers else ""  # none for a resume
        assignment = self.pool.assign(decision.decode, prefill, decision.num_uncached_tokens)
        trace_id = logctx.request_id.get() or job.request_id
        span = tracing.current().child(
            "gateway.dispatch",
            kind="client",
            attributes={"server.address": decision.decode, "splitserve.worker_request_id": job.request_id},
        )
        stream = tracing.NOOP
        call = self.channels.stub(decision.decode).Generate(
            request, metadata=(("x-request-id", trace_id), *(tracing.outgoing_metadata(span) or ()))
        )
        key = id(call)
        self._calls.setdefault(decision.decode, {})[key] = call
        last = None
        try:
            async for msg in self._read(call, key):
                self.pool.first_token(assignment)
                last = self._time_step(decision.decode, last, len(msg.token_ids))
                chunk = self._chunk(job, decision, progress, msg)
                if stream is tracing.NOOP and span.is_recording:
                    span.event("first_token")
                    stream = tracing.current().child("gateway.stream")
                if chunk.finish_reason is not None:
                    self.pool.report_success(decision.decode)
                    stream.update(
                        {
                            "gen_ai.usage.output_tokens": chunk.num_completion_tokens,
                            "gen_ai.response.finish_reasons": [chunk.finish_reason],
                        }
                    )
                yield chunk
                if chunk.finish_reason is not None:
                    return
            raise WorkerLost("the stream ended without a finish reason")
        except BaseException as exc:
            span.fail(exc)
            raise
        finally:
            stream.end()
            span.end()
            call.cancel()
            self._calls.get(decision.decode, {}).pop(key, None)
            self._lost.discard(key)
            self.pool.finish(assignment)

    def _time_step(self, address: str, last: float | None, num_tokens: int) -> float:
        """Report the time per token since the stream's previous message to on_step; the time now."""
        now = time.monotonic()
        if self.on_step is not None and last is not None and num_tokens:
            worker = self.pool.workers.get(address)
            if worker is not None:
                self.on_step(worker, (now - last) / num_tokens)
        return now

    async def _read(self, call, key: int) -> AsyncIterator[pb.GenerateResponse]:
        """The call's messages; WorkerLost for a worker failure, APIError(400) for bad input."""
        try:
            async for msg in call:
                if msg.finish_reason == pb.FINISH_REASON_ABORT:
                    raise WorkerLost("the worker aborted the request")
                yield msg
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                details = exc.details() or "invalid request"
                field = details.split(":", 1)[0]  # constraint errors start with the API field's name
                is_field = all(p.isidentifier() for p in field.split("."))
                raise APIError(400, details, param=field if is_field else None) from None
            raise WorkerLost(f"{exc.code().name}: {exc.details()}") from None
        except asyncio.CancelledError:
            if key in self._lost and not asyncio.current_task().cancelling():
                raise WorkerLost("the worker was marked down") from None
            raise

    def _chunk(self, job: Job, decision: Decision, progress: Progress, msg: pb.GenerateResponse) -> Chunk:
        new_ids = list(msg.token_ids)
        is_first = progress.num_cached_tokens is None
        if is_first:
            progress.num_cached_tokens = msg.usage.cached_tokens
            progress.num_pulled_tokens = msg.usage.pulled_tokens
            if not progress.token_ids:  # not a resume: the timings describe this prompt's prefill
                self.placer.pull_cost.observe(len(job.prompt_token_ids), msg)
        if self.metrics is not None:
            uncached = max(0, len(job.prompt_token_ids) - msg.usage.cached_tokens) if is_first else 0
            self.metrics.count_tokens(uncached, len(new_ids), is_first)
        text = progress.add(new_ids, msg.text, self.tokenizer, job.params)
        return Chunk(
            new_ids,
            text,
            list(msg.logprobs),
            _FINISH.get(msg.finish_reason),
            num_prompt_tokens=len(job.prompt_token_ids),
            num_completion_tokens=len(progress.token_ids),
            num_cached_tokens=progress.num_cached_tokens,
            num_pulled_tokens=progress.num_pulled_tokens,
            decode_worker=decision.decode,
            prefill_worker=msg.prefill_worker,
            prompt_logprobs=list(msg.prompt_logprobs),
            embedding=list(msg.embedding),
        )


def without_prompt_scoring(params):
    """A resumed attempt's params: the prompt's logprobs went out with the first attempt's first message."""
    return dataclasses.replace(params, prompt_logprobs=None) if params.prompt_logprobs is not None else params
