"""Running one generation on the workers: place, call Generate, stream, retry, resume.

    attempt 1: place(prompt) -> D (+ prefill list) -> D.Generate -> stream increments
    D fails before its first token -> place again without D -> retry the same request
    D fails after tokens were streamed -> place(prompt + tokens so far) without D and resume:
        the new D gets the prompt and the tokens already sent (`resume_output_token_ids`) and
        continues after them; the client's stream goes on

"Fails" is a gRPC error other than INVALID_ARGUMENT (that one is the caller's: 400), a stream
that ends without a finish reason or with ABORT, or the worker being marked down while the
request runs on it (its event stream broke or went silent: the watcher calls `worker_down`,
which cancels the calls in flight there). At most `max_attempts` attempts; then 503. When no
worker can take an attempt, placement is retried for up to `worker_wait_s` (counted from the
request's start) before that 503 reaches the client (router/core/readiness.py).

A resumed request continues exactly as an undisturbed run would (up to floating-point
differences between the two workers' computations): the new worker treats the tokens already
sent as its own output, so max_tokens, min_tokens and the penalties count them, and a seeded
sampler skips their draws. An unseeded sampled request continues validly from a fresh RNG. The first
text after a resume is re-derived from the token ids (`_resumed_text`), so a character the old
worker held back (half of a UTF-8 sequence) or a leading space a SentencePiece decoder strips
from the new worker's first word is not lost.

Closing the generator (the client went away) cancels the Generate call; the worker aborts the
request and frees its blocks (and the prefill worker's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from splitserve.platform import tracing
from splitserve.platform.hashing import BlockHasher, lora_extra_keys
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.tokenizer import Tokenizer
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router import logctx
from splitserve.router.api.echo import without_prompt_scoring
from splitserve.router.api.errors import APIError, NoWorkerError
from splitserve.router.core import readiness
from splitserve.router.core.worker_messages import generate_request
from splitserve.router.placement.placer import Decision, Placer
from splitserve.router.placement.pool import WorkerPool

log = logging.getLogger(__name__)

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_name: str | None = None   # a LoRA adapter the workers have loaded; None: the base model
    priority: int = 0              # the body's priority (vLLM's: lower first) and the flow-control band
    band: int = 0                  # (higher first): the workers' "priority" scheduling policy reads both


@dataclass
class Chunk:
    """An increment for the client; `usage` totals are over the whole request so far."""

    token_ids: list[int]
    text: str
    logprobs: list = field(default_factory=list)        # pb.TokenLogprob
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    decode_worker: str = ""
    prefill_worker: str = ""
    prompt_logprobs: list = field(default_factory=list)  # pb.TokenLogprob of prompt tokens 1..n-1 (first chunk)
    embedding: list = field(default_factory=list)        # the prompt's embedding (params.embed; first chunk)


class WorkerLost(Exception):
    """The attempt's worker failed; the dispatcher retries or resumes elsewhere."""


@dataclass
class _Progress:
    """What the client has been sent so far (the state a resume continues from)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_cached_tokens: int | None = None
    is_resumed: bool = False


class Dispatcher:
    def __init__(self, pool: WorkerPool, placer: Placer, hasher: BlockHasher, tokenizer: Tokenizer | None,
                 channels, max_attempts: int = 3, metrics=None, hold=None, worker_wait_s: float = 0.0,
                 adapters=None):
        self.pool = pool
        self.placer = placer
        self.hasher = hasher
        self.tokenizer = tokenizer
        self.channels = channels
        self.max_attempts = max_attempts
        self.metrics = metrics
        self.hold = hold                                         # router/core/hold.py, or None
        self.worker_wait_s = worker_wait_s                       # see _place_or_wait
        self.adapters = adapters                                 # placement/adapters.py, or None
        self._calls: dict[str, dict[int, grpc.aio.Call]] = {}   # worker -> in-flight calls
        self._lost: set[int] = set()                             # ids of calls cancelled by worker_down

    @property
    def num_open_calls(self) -> int:
        """Generate calls open on workers right now (exported on /metrics)."""
        return sum(len(calls) for calls in self._calls.values())

    def worker_down(self, address: str) -> None:
        """Called when a worker is marked down: its in-flight calls fail over."""
        for key, call in list(self._calls.get(address, {}).items()):
            self._lost.add(key)
            call.cancel()

    async def generate(self, job: Job) -> AsyncIterator[Chunk]:
        progress, excluded = _Progress(), set()
        wait_until = asyncio.get_running_loop().time() + self.worker_wait_s
        for attempt in range(1, self.max_attempts + 1):
            remaining = job.params.max_tokens - len(progress.token_ids)
            if remaining <= 0:
                yield Chunk([], "", finish_reason="length", num_prompt_tokens=len(job.prompt_token_ids),
                            num_completion_tokens=len(progress.token_ids),
                            num_cached_tokens=progress.num_cached_tokens or 0)
                return
            decision = await self._place_or_wait(job, progress, excluded, attempt, wait_until)
            try:
                async for chunk in self._attempt(job, decision, progress):
                    yield chunk
                return
            except WorkerLost as exc:
                excluded.add(decision.decode)
                progress.is_resumed = bool(progress.token_ids)
                self.pool.report_failure(decision.decode, str(exc))
                self._count("resumes" if progress.token_ids else "retries")
                log.warning("%s: decode worker %s failed after %d tokens (%s); attempt %d of %d", job.request_id,
                            decision.decode, len(progress.token_ids), exc, attempt, self.max_attempts)
        raise NoWorkerError(f"request failed on {self.max_attempts} workers; last error above in the router log")

    async def _place_or_wait(self, job: Job, progress: _Progress, excluded: set[str], attempt: int,
                             wait_until: float) -> Decision:
        """Place; while nothing can serve (503), retry every POLL_S until `wait_until`, then raise."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                return await self._place(job, progress, excluded, attempt)
            except NoWorkerError as exc:
                if exc.status != 503 or loop.time() >= wait_until:
                    raise
            await asyncio.sleep(min(readiness.POLL_S, max(wait_until - loop.time(), 0.0)))

    async def _place(self, job: Job, progress: _Progress, excluded: set[str], attempt: int) -> Decision:
        token_ids = job.prompt_token_ids + progress.token_ids
        if self.hold is not None:
            await self.hold.wait(lambda: bool(self.pool.decode_workers()))
        t0 = time.perf_counter()
        lora_workers = None
        if job.lora_name is not None and self.adapters is not None:
            lora_workers = self.adapters.workers_with(job.lora_name)
        decision = await self.placer.place(len(token_ids), self._hashes(job, token_ids), frozenset(excluded),
                                           lora_name=job.lora_name, lora_workers=lora_workers)
        seconds = time.perf_counter() - t0
        _trace_placement(decision, attempt, seconds)
        log.info("%s attempt %d: decode %s, prefill %s, %d cached blocks, %d uncached tokens", job.request_id,
                 attempt, decision.decode, ",".join(decision.prefill) or "local", decision.num_cached_blocks,
                 decision.num_uncached_tokens)
        if self.metrics is not None:
            self.metrics.observe_decision(decision, len(token_ids) // self.hasher.block_size, seconds)
        return decision

    def _hashes(self, job: Job, token_ids: list[int]) -> list[bytes]:
        """The prompt's block hashes as the workers compute them: with the adapter's identity for
        a LoRA request (none while its digest is unknown: no prefix matching rather than wrong)."""
        if job.lora_name is None:
            return self.hasher.hash_blocks(token_ids)
        digest = self.adapters.digest(job.lora_name) if self.adapters is not None else None
        if digest is None:
            return []
        return self.hasher.hash_blocks(token_ids, lora_extra_keys(job.lora_name, digest))

    async def _attempt(self, job: Job, decision: Decision, progress: _Progress) -> AsyncIterator[Chunk]:
        params = without_prompt_scoring(job.params) if progress.token_ids else job.params
        request = generate_request(job.request_id, job.prompt_token_ids, params, decision,
                                   self.placer.config.disaggregation, resume_output_token_ids=progress.token_ids,
                                   lora_name=job.lora_name, priority=job.priority, band=job.band)
        prefill = request.prefill_workers[0] if request.prefill_workers else ""   # none for a resume
        assignment = self.pool.assign(decision.decode, prefill, decision.num_uncached_tokens)
        trace_id = logctx.request_id.get() or job.request_id
        span = tracing.current().child("gateway.dispatch", kind="client", attributes={
            "server.address": decision.decode, "splitserve.worker_request_id": job.request_id})
        stream = tracing.NOOP
        call = self.channels.stub(decision.decode).Generate(
            request, metadata=(("x-request-id", trace_id), *(tracing.outgoing_metadata(span) or ())))
        key = id(call)
        self._calls.setdefault(decision.decode, {})[key] = call
        try:
            async for msg in self._read(call, key):
                self.pool.first_token(assignment)
                chunk = self._chunk(job, decision, progress, msg)
                if stream is tracing.NOOP and span.is_recording:
                    span.event("first_token")
                    stream = tracing.current().child("gateway.stream")
                if chunk.finish_reason is not None:
                    self.pool.report_success(decision.decode)
                    stream.update({"gen_ai.usage.output_tokens": chunk.num_completion_tokens,
                                   "gen_ai.response.finish_reasons": [chunk.finish_reason]})
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

    def _chunk(self, job: Job, decision: Decision, progress: _Progress, msg: pb.GenerateResponse) -> Chunk:
        new_ids = list(msg.token_ids)
        text = self._resumed_text(job.params, progress, new_ids, msg.text) if progress.is_resumed else msg.text
        is_first = progress.num_cached_tokens is None
        if is_first:
            progress.num_cached_tokens = msg.usage.cached_tokens
            if not progress.token_ids:   # not a resume: the timings describe this prompt's prefill
                self.placer.pull_cost.observe(len(job.prompt_token_ids), msg)
        if self.metrics is not None:
            uncached = max(0, len(job.prompt_token_ids) - msg.usage.cached_tokens) if is_first else 0
            self.metrics.count_tokens(uncached, len(new_ids), is_first)
        progress.token_ids += new_ids
        progress.text += text
        return Chunk(new_ids, text, list(msg.logprobs), _FINISH.get(msg.finish_reason),
                     num_prompt_tokens=len(job.prompt_token_ids), num_completion_tokens=len(progress.token_ids),
                     num_cached_tokens=progress.num_cached_tokens, decode_worker=decision.decode,
                     prefill_worker=msg.prefill_worker, prompt_logprobs=list(msg.prompt_logprobs),
                     embedding=list(msg.embedding))

    def _resumed_text(self, params: SamplingParams, progress: _Progress, new_ids: list[int], text: str) -> str:
        """The first text after a resume, from the token ids when they explain the worker's text."""
        progress.is_resumed = False
        if self.tokenizer is None:
            return text
        full = self.tokenizer.decode(progress.token_ids + new_ids, skip_special_tokens=params.skip_special_tokens)
        if full.startswith(progress.text) and not full.endswith("\ufffd"):
            derived = full[len(progress.text):]
            if derived.endswith(text):
                return derived
        return text

    def _count(self, what: str) -> None:
        if self.metrics is not None:
            self.metrics.count(what)


def _trace_placement(decision: Decision, attempt: int, seconds: float) -> None:
    """The placement as a span of the request's: the chosen workers, their scores and why."""
    parent = tracing.current()
    if not parent.is_recording:
        return
    end = time.monotonic()
    reason = ("kv pull" if decision.pull else "remote prefill" if decision.prefill else "local prefill")
    scores = {f"splitserve.placement.score.{role}": [f"{address}={score:.3f}" for address, score in by.items()]
              for role, by in decision.scores.items()}
    parent.record("gateway.placement", end - seconds, end, {
        "splitserve.placement.attempt": attempt, "splitserve.placement.decode": decision.decode,
        "splitserve.placement.prefill": list(decision.prefill), "splitserve.placement.reason": reason,
        "splitserve.placement.cached_blocks": decision.num_cached_blocks,
        "splitserve.placement.uncached_tokens": decision.num_uncached_tokens, **scores})

