"""How busy the simulated day is, and how large a replica budget a platform team would give it.

The two are set separately on purpose: the trace's size is a property of the trace and the
machine, the budget a decision taken from the trace, never the other way round (an earlier
version derived the peak from the budget, so any budget was exactly too small for the bursts
and no fixed configuration could reach the SLO).

Work of one request, in replica-seconds at the profiled capacity (planner/profile.py):
- prefill: uncached prompt tokens / the profiled prefill tokens/s at its prompt length;
- decode: (output tokens - 1) / the profiled decode tokens/s at the ITL target and the
  request's mean context (prompt + half the answer).

Trace size (`peak_rps_for_load`): the peak arrival rate is chosen so that at the diurnal peak
(noon, bursts aside) the arriving requests bring `load` replicas' worth of work per second.
The mean work per request is that of 5,000 requests drawn from noon's mix with a fixed seed.
`load` is in units of this machine's replicas, so a faster engine (a re-measured profile) gets
a proportionally busier day rather than an idle one.

Budget (`platform_budget`): what a platform team would reserve after looking at the day: the
busiest window (15 minutes of a 24-hour day; bursts included) of each pool in replicas of work,
at the planned utilisation, summed over the pools, plus `headroom`, rounded up.
"""

from __future__ import annotations

import math
import random

from planner_trace import DAY_S, Request, make_request

from splitserve.planner.profile import CapacityProfile

MIX_SAMPLE, MIX_SEED = 5000, 12345


def work_s(r: Request, profile: CapacityProfile, itl_s: float) -> tuple[float, float]:
    """(prefill, decode) replica-seconds one request needs at the profiled capacity."""
    prefill = max(1, r.prompt_tokens - r.cached_tokens) / profile.prefill_tokens_per_s(r.prompt_tokens)
    ctx = r.prompt_tokens + r.output_tokens / 2
    decode = max(0, r.output_tokens - 1) / profile.decode_tokens_per_s(itl_s, ctx)
    return prefill, decode


def peak_rps_for_load(profile: CapacityProfile, itl_s: float, load: float, day_s: float = DAY_S) -> float:
    """The trace's peak rate (req/s, before bursts) at which noon brings `load` replicas of work."""
    if not load > 0 or not itl_s > 0:
        raise ValueError(f"load and itl_s must be > 0, got {load}, {itl_s}")
    rng = random.Random(MIX_SEED)
    works = [sum(work_s(make_request(rng, day_s / 2, day_s), profile, itl_s)) for _ in range(MIX_SAMPLE)]
    return load / (sum(works) / len(works))


def busiest(trace: list[Request], profile: CapacityProfile, itl_s: float, window_s: float) -> dict[str, float]:
    """Per pool, the most replicas of work any window of the trace brought."""
    windows: dict[int, list[float]] = {}
    for r in trace:
        p, d = work_s(r, profile, itl_s)
        w = windows.setdefault(int(r.arrival_s // window_s), [0.0, 0.0])
        w[0] += p / window_s
        w[1] += d / window_s
    return {
        "prefill": max((w[0] for w in windows.values()), default=0.0),
        "decode": max((w[1] for w in windows.values()), default=0.0),
    }


def platform_budget(
    trace: list[Request],
    profile: CapacityProfile,
    itl_s: float,
    utilization: float = 0.8,
    headroom: float = 0.25,
    day_s: float = DAY_S,
) -> tuple[int, dict[str, float]]:
    """The budget (replicas, at least 2) and the busiest windows' work it was sized from."""
    if not 0 < utilization <= 1 or headroom < 0:
        raise ValueError(f"utilization must be in (0, 1] and headroom >= 0, got {utilization}, {headroom}")
    peak = busiest(trace, profile, itl_s, max(60.0, 900.0 * day_s / DAY_S))
    return max(2, math.ceil((peak["prefill"] + peak["decode"]) / utilization * (1 + headroom) - 1e-9)), peak
