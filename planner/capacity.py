"""Online correction of the profiled per-replica capacity from observed throughput.

A replica that served X tokens/s while its latency met the SLO proves the capacity is at least X;
one that served X while missing the SLO (it was saturated) proves it is at most X. The corrected
capacity is the profiled one raised to the 90th percentile of the first kind and lowered to the
median of the second, over the last `window` samples of each pool. Samples from replicas younger
than `warmup_s` are dropped: a cold replica's first passes are slow (graph capture, cache
misses), and trusting them makes a planner add replicas it does not need (Dynamo #12430).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from splitserve.planner.config import POOLS


@dataclass(frozen=True)
class ReplicaSample:
    pool: str
    replica_id: str
    age_s: float
    tokens_per_s: float
    within_slo: bool
    saturated: bool = True  # only a busy replica says anything about capacity


class OnlineCapacity:
    """Owned by one planner loop; `observe` each tick's samples, `factor` per pool."""

    def __init__(self, warmup_s: float, window: int = 64) -> None:
        self.warmup_s = warmup_s
        self._ok = {p: deque(maxlen=window) for p in POOLS}
        self._bad = {p: deque(maxlen=window) for p in POOLS}

    def observe(self, samples: list[ReplicaSample]) -> int:
        """Record the samples; returns how many were used (the rest were warming up or idle)."""
        used = 0
        for s in samples:
            if s.age_s < self.warmup_s or not s.saturated or s.tokens_per_s <= 0:
                continue
            (self._ok if s.within_slo else self._bad)[s.pool].append(s.tokens_per_s)
            used += 1
        return used

    def capacity(self, pool: str, profiled: float) -> float:
        mu = profiled
        ok, bad = sorted(self._ok[pool]), sorted(self._bad[pool])
        if ok:
            mu = max(mu, ok[min(len(ok) - 1, int(0.9 * len(ok)))])
        if bad:
            mu = min(mu, bad[len(bad) // 2])
        return mu
