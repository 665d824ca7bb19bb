"""`splitserve up --planner`: the SLA planner's control loop on one machine, with real workers.

Every `tick_s` the loop reads demand from the router itself (uncached prompt tokens and output
tokens it has seen, as rates over the last `window_s`) and measured latency over the last
`latency_window_s` (planner/window.py: the router's TTFT histogram minus the decode workers'
KV-transfer time, and the decode workers' ITL histogram, scraped from their /metrics), asks
planner/law.py for the desired prefill and decode workers, and applies the answer to local
`splitserve worker` processes:
- up: start a worker (a thread waits for its READY line, then the router starts watching it);
  a starting worker counts as Pending for the planner;
- down: only an idle worker (nothing in flight through this router) is removed: the router
  forgets it first, then it gets SIGTERM. With none idle the loop waits for the next tick, so
  a scale-down never fails a request.
Both pools together stay within `max_workers` (the planner's replica budget).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable

from prometheus_client import generate_latest

from splitserve.planner import signals as S
from splitserve.planner.law import Observation, Planner, PoolObservation
from splitserve.planner.window import ScrapeWindow, measured_latency

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 300.0
SCRAPE_TIMEOUT_S = 2.0


def http_get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S).read().decode()


class LocalPlannerLoop:
    def __init__(
        self,
        planner: Planner,
        router,
        spawn: Callable[[str], object],
        workers: dict[str, list],
        tick_s: float,
        window_s: float = 10.0,
        latency_window_s: float = 30.0,
        fetch: Callable[[str], str] = http_get,
    ):
        self.planner, self.router, self.spawn, self.fetch = planner, router, spawn, fetch
        self.workers = workers  # role -> [WorkerProcess] serving
        self.starting: dict[str, list[tuple[object, float]]] = {"prefill": [], "decode": []}
        self.tick_s, self.window_s = tick_s, window_s
        self.samples: deque = deque()  # (t, uncached prompt tokens, output tokens, requests)
        self.latency = ScrapeWindow(latency_window_s)
        self.decisions: list[dict] = []  # what was decided, for logs and tests

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.tick()
            except Exception:  # one bad tick must not stop scaling
                log.exception("planner tick failed")

    async def scrape(self, now: float) -> None:
        """The router's metrics (in process) and every serving decode worker's /metrics into the
        latency window; a worker that cannot be read this tick is skipped."""
        self.latency.add(now, "router", S.flatten(generate_latest(self.router.metrics.registry).decode()))
        decode = list(self.workers["decode"])
        texts = await asyncio.gather(*(asyncio.to_thread(self._read, w.metrics_url) for w in decode))
        for w, text in zip(decode, texts, strict=True):
            self.latency.add(now, f"decode/{w.address}", None if text is None else S.flatten(text))
        self.latency.keep_only({"router", *(f"decode/{w.address}" for w in decode)})

    def _read(self, url: str) -> str | None:
        try:
            return self.fetch(url)
        except (OSError, ValueError) as exc:
            log.warning("planner: cannot read %s (%s)", url, exc)
            return None

    def observe(self, now: float) -> Observation:
        m = self.router.metrics
        ttft, itl = measured_latency(self.latency.delta("router"), self.latency.delta("decode/"))
        self.samples.append((now, m.num_uncached_prompt_tokens, m.num_output_tokens, m.num_planned_requests))
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.window_s:
            self.samples.popleft()
        (t0, p0, o0, r0), (t1, p1, o1, r1) = self.samples[0], self.samples[-1]
        dt = max(t1 - t0, 1e-9)
        n = r1 - r0
        prefill_rate = (p1 - p0) / dt if t1 > t0 else 0.0
        output_rate = (o1 - o0) / dt if t1 > t0 else 0.0
        return Observation(
            now=now,
            uncached_prompt_tokens_per_s=prefill_rate,
            output_tokens_per_s=output_rate,
            prefill=self._pool_obs("prefill", now),
            decode=self._pool_obs("decode", now),
            mean_prompt_tokens=(p1 - p0) / n if n else 512.0,
            mean_output_tokens=(o1 - o0) / n if n else 128.0,
            inflight_decode_seqs=sum(w.num_inflight for w in self.router.pool.decode_workers()),
            ttft_p90_s=ttft,
            itl_p90_s=itl,
        )

    def _pool_obs(self, role: str, now: float) -> PoolObservation:
        starting = self.starting[role]
        return PoolObservation(
            ready=len(self.workers[role]),
            pending=len(starting),
            oldest_pending_s=max((now - t for _, t in starting), default=0.0),
        )

    async def tick(self) -> None:
        now = time.monotonic()
        await self.scrape(now)
        obs = self.observe(now)
        decision = self.planner.tick(obs)
        self.decisions.append(
            {
                "t": now,
                **decision.desired(),
                "ttft_p90_s": obs.ttft_p90_s,
                "itl_p90_s": obs.itl_p90_s,
                "trims": (decision.prefill.trim, decision.decode.trim),
                "reasons": (decision.prefill.reason, decision.decode.reason),
            }
        )
        for role, want in decision.desired().items():
            have = len(self.workers[role]) + len(self.starting[role])
            if want != have:
                reason = getattr(decision, role).reason
                print(
                    f"splitserve up: planner: {role} {have} -> {want} ({reason}; measured TTFT p90 "
                    f"{_ms(obs.ttft_p90_s)}, ITL p90 {_ms(obs.itl_p90_s)})",
                    file=sys.stderr,
                    flush=True,
                )
            for _ in range(want - have):
                self._start(role)
            if want < have and not self.starting[role]:
                await self._stop_one_idle(role)

    def _start(self, role: str) -> None:
        proc = self.spawn(role)
        entry = (proc, time.monotonic())
        self.starting[role].append(entry)
        loop = asyncio.get_running_loop()
        log.info("planner: starting a %s worker", role)

        def wait() -> None:
            try:
                proc.wait_ready(READY_TIMEOUT_S)
                ok = True
            except RuntimeError:
                log.exception("planner: a %s worker failed to start", role)
                ok = False
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._started(role, entry, ok)))

        threading.Thread(target=wait, daemon=True).start()

    async def _started(self, role: str, entry, ok: bool) -> None:
        self.starting[role].remove(entry)
        if not ok:
            entry[0].stop()
            return
        self.workers[role].append(entry[0])
        await self.router._on_workers(self.addresses())
        print(f"splitserve up: planner: {role} workers serving: {len(self.workers[role])}", file=sys.stderr, flush=True)

    async def _stop_one_idle(self, role: str) -> None:
        if len(self.workers[role]) <= 1 and role == "decode":
            return
        states = {w.address: w for w in self.router.pool.workers.values()}
        idle = [p for p in self.workers[role] if states.get(p.address) is None or states[p.address].num_inflight == 0]
        if not idle:
            return
        proc = idle[-1]
        self.workers[role].remove(proc)
        await self.router._on_workers(self.addresses())
        await asyncio.to_thread(proc.stop)
        print(f"splitserve up: planner: {role} workers serving: {len(self.workers[role])}", file=sys.stderr, flush=True)

    def addresses(self) -> set[str]:
        return {p.address for ps in self.workers.values() for p in ps}

    def stop_all(self) -> None:
        for role in self.starting:
            for proc, _ in self.starting[role]:
                proc.stop()


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
