"""Measured latency over a sliding window, from cumulative Prometheus scrapes.

`splitserve up --planner` scrapes its router (in process) and every decode worker (/metrics)
each tick and keeps, per source, the flattened scrapes (signals.flatten) of the last `window_s`.
The window's delta is, summed over sources, the newest scrape minus the oldest one still in the
window (signals.delta: a counter that went down means a restart and counts from zero); a
source seen only once in the window gives nothing yet (a baseline). A source that is no longer
scraped (a stopped worker) leaves the window with its history, so its samples stop counting.

From that delta, as the cluster planner reads it (planner/plan_loop.py):
- TTFT p90 for prefill: the router's TTFT histogram p90 minus the mean KV-transfer time the
  decode workers measured (shipping KV is not prefill's work), floored at zero. The router
  observes TTFT only for streamed responses (what the user sees); when the window holds none
  (non-streaming traffic), the decode workers' own TTFT histogram stands in: from a request's
  arrival at the worker to its first token, so queueing, remote prefill and transfer, without
  the router's few milliseconds;
- ITL p90: the decode workers' inter-token-latency histogram.
Either is None when the window saw no sample of it: the law then applies no trim, which is
what "no measured latency" must mean (not "latency zero").

A window longer than one tick (the default in `up` is 30 s against a 5 s tick) keeps the p90
from swinging on the handful of requests one tick sees on a small machine.
"""

from __future__ import annotations

from collections import deque

from splitserve.planner import signals as S


class ScrapeWindow:
    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._history: dict[str, deque[tuple[float, dict[str, float]]]] = {}

    def add(self, now: float, source: str, flat: dict[str, float] | None) -> None:
        """One scrape of `source` at `now`; None (it could not be read) is skipped."""
        if flat is None:
            return
        hist = self._history.setdefault(source, deque())
        hist.append((now, flat))
        # Keep the newest scrape at or before the window's start as the baseline.
        while len(hist) > 1 and hist[1][0] <= now - self.window_s:
            hist.popleft()

    def keep_only(self, sources: set[str]) -> None:
        """Forget every source not in `sources` (workers that were stopped)."""
        for gone in set(self._history) - sources:
            del self._history[gone]

    def delta(self, prefix: str = "") -> dict[str, float]:
        """What happened within the window, summed over the sources whose name starts with `prefix`."""
        parts = [
            S.delta(h[-1][1], h[0][1]) for src, h in self._history.items() if src.startswith(prefix) and len(h) > 1
        ]
        return S.add_up(parts)


def measured_latency(router: dict[str, float], decode: dict[str, float]) -> tuple[float | None, float | None]:
    """(prefill TTFT p90 without KV transfer, decode ITL p90) from a router and a decode delta."""
    ttft = S.p90(router, "rttft")
    if ttft is None:
        ttft = S.p90(decode, "ttft")  # no streamed response in the window: the workers' TTFT
    if ttft is not None:
        ttft = max(0.0, ttft - S.mean(decode, "kvt"))
    return ttft, S.p90(decode, "itl")
