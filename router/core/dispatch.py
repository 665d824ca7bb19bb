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
text after a resume is re-derived from the token ids (core/job.py `Progress.add`), so a character the old
worker held back (half of a UTF-8 sequence) or a leading space a SentencePiece decoder strips
from the new worker's first word is not lost.

One attempt, its Generate call and how its failures are told apart, is core/worker_calls.py.
Closing the generator (the client went away) cancels the Generate call; the worker aborts the
request and frees its blocks (and the prefill worker's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from splitserve.platform.hashing import BlockHasher, lora_extra_keys
from splitserve.platform.observability import tracing
from splitserve.platform.tokenizer import Tokenizer
from splitserve.router.core import readiness
from splitserve.router.core.job import Chunk, Job, Progress, WorkerLost
from splitserve.router.core.worker_calls import WorkerCalls
from splitserve.router.errors import NoWorkerError
from splitserve.router.placement.placer import Decision, PlacementRequest, Placer
from splitserve.router.placement.pool import WorkerPool

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        placer: Placer,
        hasher: BlockHasher,
        tokenizer: Tokenizer | None,
        channels,
        max_attempts: int = 3,
        metrics=None,
        hold=None,
        worker_wait_s: float = 0.0,
        adapters=None,
    ):
        self.pool = pool
        self.placer = placer
        self.hasher = hasher
        self.max_attempts = max_attempts
        self.metrics = metrics
        self.hold = hold  # router/core/hold.py, or None
        self.worker_wait_s = worker_wait_s  # see _place_or_wait
        self.adapters = adapters  # placement/adapters.py, or None
        self.calls = WorkerCalls(pool, placer, tokenizer, channels, metrics)

    @property
    def num_open_calls(self) -> int:
        """Generate calls open on workers right now (exported on /metrics)."""
        return self.calls.num_open

    def worker_down(self, address: str) -> None:
        """Called when a worker is marked down: its in-flight calls fail over."""
        self.calls.worker_down(address)

    async def generate(self, job: Job) -> AsyncIterator[Chunk]:
        progress, excluded = Progress(), set()
        wait_until = asyncio.get_running_loop().time() + self.worker_wait_s
        for attempt in range(1, self.max_attempts + 1):
            remaining = job.params.max_tokens - len(progress.token_ids)
            if remaining <= 0:
                yield Chunk(
                    [],
                    "",
                    finish_reason="length",
                    num_prompt_tokens=len(job.prompt_token_ids),
                    num_completion_tokens=len(progress.token_ids),
                    num_cached_tokens=progress.num_cached_tokens or 0,
                )
                return
            decision = await self._place_or_wait(job, progress, excluded, attempt, wait_until)
            try:
                async for chunk in self.calls.attempt(job, decision, progress):
                    yield chunk
                return
            except WorkerLost as exc:
                excluded.add(decision.decode)
                progress.is_resumed = bool(progress.token_ids)
                self.pool.report_failure(decision.decode, str(exc))
                self._count("resumes" if progress.token_ids else "retries")
                log.warning(
                    "%s: decode worker %s failed after %d tokens (%s); attempt %d of %d",
                    job.request_id,
                    decision.decode,
                    len(progress.token_ids),
                    exc,
                    attempt,
                    self.max_attempts,
                )
        raise NoWorkerError(f"request failed on {self.max_attempts} workers; last error above in the router log")

    async def _place_or_wait(
        self, job: Job, progress: Progress, excluded: set[str], attempt: int, wait_until: float
    ) -> Decision:
        """Place; while nothing can serve (503), retry every POLL_S until `wait_until`, then raise."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                return await self._place(job, progress, excluded, attempt)
            except NoWorkerError as exc:
                if exc.status != 503 or loop.time() >= wait_until:
                    raise
            await asyncio.sleep(min(readiness.POLL_S, max(wait_until - loop.time(), 0.0)))

    async def _place(self, job: Job, progress: Progress, excluded: set[str], attempt: int) -> Decision:
        token_ids = job.prompt_token_ids + progress.token_ids
        if self.hold is not None:
            await self.hold.wait(lambda: bool(self.pool.decode_workers()))
        t0 = time.perf_counter()
        lora_workers = None
        if job.lora_name is not None and self.adapters is not None:
            lora_workers = self.adapters.workers_with(job.lora_name)
        decision = await self.placer.place(
            PlacementRequest(
                len(token_ids),
                self._hashes(job, token_ids),
                frozenset(excluded),
                lora_name=job.lora_name,
                lora_workers=lora_workers,
            )
        )
        seconds = time.perf_counter() - t0
        _trace_placement(decision, attempt, seconds)
        log.info(
            "%s attempt %d: decode %s, prefill %s, %d cached blocks, %d uncached tokens",
            job.request_id,
            attempt,
            decision.decode,
            ",".join(decision.prefill) or "local",
            decision.num_cached_blocks,
            decision.num_uncached_tokens,
        )
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

    def _count(self, what: str) -> None:
        if self.metrics is not None:
            self.metrics.count(what)


def _trace_placement(decision: Decision, attempt: int, seconds: float) -> None:
    """The placement as a span of the request's: the chosen workers, their scores and why."""
    parent = tracing.current()
    if not parent.is_recording:
        return
    end = time.monotonic()
    reason = "kv pull" if decision.pull else "remote prefill" if decision.prefill else "local prefill"
    scores = {
        f"splitserve.placement.score.{role}": [f"{address}={score:.3f}" for address, score in by.items()]
        for role, by in decision.scores.items()
    }
    parent.record(
        "gateway.placement",
        end - seconds,
        end,
        {
            "splitserve.placement.attempt": attempt,
            "splitserve.placement.decode": decision.decode,
            "splitserve.placement.prefill": list(decision.prefill),
            "splitserve.placement.reason": reason,
            "splitserve.placement.cached_blocks": decision.num_cached_blocks,
            "splitserve.placement.uncached_tokens": decision.num_uncached_tokens,
            **scores,
        },
    )
