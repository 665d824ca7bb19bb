"""The synthetic 24-hour trace of bench/planner_sim.py: documented, seeded, reproducible.

Arrival rate (requests/s) at time t (seconds from midnight):
    rate(t) = peak · (0.15 + 0.85 · (1 − cos(2πt / 86,400)) / 2) · burst(t)
a diurnal curve from 15 % of peak at midnight to the peak at noon. burst(t) multiplies the rate
by 1.5–2.5× inside `bursts` windows of 5–15 minutes placed uniformly over the day.
Arrivals are a non-homogeneous Poisson process drawn by thinning.

Each request is one of two kinds:
- "rag": long prompt, short answer — prompt lognormal (median 1,500, σ 0.4, clamped 64–4,000),
  answer lognormal (median 48, σ 0.5, clamped 4–512), 30 % of the prompt cached on average;
- "chat": short prompt, long answer — prompt median 200, answer median 256, nothing cached.
The share of "chat" shifts from 20 % before 10:00 to 80 % after 14:00, linearly between: the
prompt/answer mix moves from prefill-heavy to decode-heavy across the afternoon.

`peak` is an input: bench/planner_sizing.py derives it from the machine's capacity profile
(replicas of work at noon), and the replica budget is then sized from the generated trace.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

DAY_S = 86_400.0


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    kind: str


def chat_share(t: float, day_s: float = DAY_S) -> float:
    lo, hi = 10 / 24 * day_s, 14 / 24 * day_s
    return 0.2 + 0.6 * min(1.0, max(0.0, (t - lo) / (hi - lo)))


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(median * math.exp(rng.gauss(0, sigma))))))


def make_request(rng: random.Random, t: float, day_s: float = DAY_S) -> Request:
    if rng.random() < chat_share(t, day_s):
        return Request(t, _lognormal(rng, 200, 0.5, 16, 2000), 0, _lognormal(rng, 256, 0.4, 16, 1024), "chat")
    prompt = _lognormal(rng, 1500, 0.4, 64, 4000)
    return Request(t, prompt, int(prompt * rng.uniform(0.0, 0.6)), _lognormal(rng, 48, 0.5, 4, 512), "rag")


def generate(
    seed: int, peak_rps: float, duration_s: float = DAY_S, bursts: int = 6, day_s: float = DAY_S
) -> list[Request]:
    """The trace; `day_s` compresses the diurnal cycle (the smoke test uses a short day)."""
    if peak_rps <= 0 or duration_s <= 0:
        raise ValueError(f"peak_rps and duration_s must be > 0, got {peak_rps}, {duration_s}")
    rng = random.Random(seed)
    windows = []
    for _ in range(bursts):
        start = rng.uniform(0, duration_s)
        windows.append((start, start + rng.uniform(300, 900) * day_s / DAY_S, rng.uniform(1.5, 2.5)))

    def rate(t: float) -> float:
        burst = max([m for a, b, m in windows if a <= t < b], default=1.0)
        return peak_rps * (0.15 + 0.85 * (1 - math.cos(2 * math.pi * t / day_s)) / 2) * burst

    rate_max = peak_rps * 2.5
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate_max)
        if t >= duration_s:
            return out
        if rng.random() * rate_max < rate(t):
            out.append(make_request(rng, t, day_s))
