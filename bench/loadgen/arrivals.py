"""When each session starts: open-loop Poisson/gamma arrivals, as `vllm bench serve` draws them.

Inter-arrival gaps are gamma(shape=burstiness, scale=1/(rate·burstiness)): mean 1/rate for any
burstiness, coefficient of variation 1/sqrt(burstiness). Burstiness 1 is a Poisson process,
< 1 is burstier, inf is constant spacing. As in vLLM, the cumulative times are then rescaled so
that the last arrival is at exactly n/rate: the offered load does not drift 1–2% with the seed.
Rate inf (and fixed-concurrency runs) send everything at t = 0.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Seconds from the start of the run at which each of `n` arrivals is due (non-decreasing)."""
    assert n >= 1 and rate > 0 and burstiness > 0
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (n / rate) / times[-1]
    return times.tolist()
