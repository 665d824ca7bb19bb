"""Driving a workload against an endpoint: warm-up, then the measured phase.

    warm-up:   the workload's warm-up requests, all at once under the concurrency limit (as
               vLLM's --num-warmups); their results are kept apart and never enter the metrics
    measured:  t0 = now; session i starts at t0 + offset_i (arrivals.py; all 0 with
               --concurrency); its turns go one after another, each after its think time;
               every request waits for the concurrency limit (a semaphore, vLLM's
               --max-concurrency) and its clock starts when it is sent
    duration:  t0 → the last request finished

The client's own CPU time (time.process_time, all threads of this process) over the measured
phase is reported beside the duration: the client shares the machine with the server. As vLLM's
client does, the objects alive before the measured phase are frozen out of the garbage
collector, so that a full collection cannot stall the event loop between two chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from splitserve.bench.loadgen.arrivals import arrival_offsets
from splitserve.bench.loadgen.client import RequestResult, encode_payload, send
from splitserve.bench.loadgen.workloads import BenchRequest, Workload


@dataclass(frozen=True)
class RunConfig:
    url: str  # base URL; requests go to {url}/v1/completions
    model: str
    rate: float | None = None  # sessions per second (inf: all at t0); None with concurrency
    concurrency: int | None = None
    burstiness: float = 1.0
    seed: int = 0
    request_timeout_s: float = 600.0
    api_key: str | None = None
    progress: bool = True
    extra_body: dict = field(default_factory=dict)  # merged into every request body
    prompt_format: str = "token-ids"  # or "text" (workloads.as_text)


@dataclass
class RunResult:
    results: list[RequestResult]
    warmup: list[RequestResult]
    duration_s: float
    client_cpu_s: float
    offsets_s: list[float] = field(default_factory=list)  # scheduled session starts


class Progress:
    """A plain-text progress line on stderr (rewritten in place on a terminal)."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = total, label, enabled
        self.done = self.failed = 0
        self.t0 = time.perf_counter()
        self.is_tty = sys.stderr.isatty()
        self._last_print = -1.0

    def update(self, r: RequestResult) -> None:
        self.done += 1
        self.failed += not r.success
        now = time.perf_counter()
        step = 0.5 if self.is_tty else 10.0
        if self.enabled and (self.done == self.total or now - self._last_print >= step):
            self._last_print = now
            start, end = ("\r", "\n" if self.done == self.total else "") if self.is_tty else ("", "\n")
            print(
                f"{start}{self.label}: {self.done}/{self.total} done, {self.failed} failed, {now - self.t0:.1f} s",
                end=end,
                file=sys.stderr,
                flush=True,
            )


def _client(cfg: RunConfig) -> httpx.AsyncClient:
    # trust_env=False: a proxy from the environment would sit inside every measurement.
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.request_timeout_s, connect=30.0),
        trust_env=False,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        headers=headers,
    )


def _record(index: int, req: BenchRequest) -> RequestResult:
    return RequestResult(index, req.category, req.tag, req.num_prompt_tokens, req.max_tokens)


async def _limited(limit, client, url, body, out: RequestResult, t0: float, progress: Progress) -> RequestResult:
    queued = time.perf_counter()
    async with limit:
        await send(client, url, body, out, t0)
    out.client_queue_s = out.start_s - (queued - t0)
    progress.update(out)
    return out


async def _warmup(cfg: RunConfig, wl: Workload, client, url, limit) -> list[RequestResult]:
    if not wl.warmup:
        return []
    progress = Progress(len(wl.warmup), "warm-up", cfg.progress)
    t0 = time.perf_counter()
    return list(
        await asyncio.gather(
            *[
                _limited(limit, client, url, encode_payload(cfg.model, r, cfg.extra_body), _record(i, r), t0, progress)
                for i, r in enumerate(wl.warmup)
            ]
        )
    )


async def run(cfg: RunConfig, wl: Workload) -> RunResult:
    url = cfg.url.rstrip("/") + "/v1/completions"
    limit = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else contextlib.nullcontext()
    offsets = (
        arrival_offsets(len(wl.sessions), cfg.rate, cfg.burstiness, np.random.default_rng([cfg.seed, 1]))
        if cfg.rate
        else [0.0] * len(wl.sessions)
    )
    bodies = [[encode_payload(cfg.model, r, cfg.extra_body) for r in s] for s in wl.sessions]
    async with _client(cfg) as client:
        warm = await _warmup(cfg, wl, client, url, limit)
        progress = Progress(wl.num_requests, "bench", cfg.progress)
        gc.collect()
        gc.freeze()
        cpu0, t0 = time.process_time(), time.perf_counter()

        async def session(i: int, first_index: int) -> list[RequestResult]:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            out = []
            for k, (req, body) in enumerate(zip(wl.sessions[i], bodies[i])):
                if req.think_s:
                    await asyncio.sleep(req.think_s)
                out.append(await _limited(limit, client, url, body, _record(first_index + k, req), t0, progress))
            return out

        firsts = np.cumsum([0] + [len(s) for s in wl.sessions[:-1]]).tolist()
        try:
            per_session = await asyncio.gather(*[session(i, f) for i, f in enumerate(firsts)])
        finally:
            gc.unfreeze()
        duration, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    results = sorted((r for s in per_session for r in s), key=lambda r: r.index)
    return RunResult(results, warm, duration, cpu, offsets)
