"""The scaling policies bench/planner_sim.py compares; each is `policy(sim, t) -> {pool: replicas}`,
called every tick with the simulation's state (arrivals since the last tick, queues, replicas).

- fixed(p, d): a constant configuration;
- planner_policy: planner/law.py fed like live: rates over the last minute (Prometheus
  rate[1m]), mean lengths, in-flight decode sequences, TTFT/ITL p90 of the last tick's requests,
  starting replicas as Pending;
- queue_policy: today's KEDA/HPA on vllm:num_requests_waiting.
"""

from __future__ import annotations

import math
from collections import deque

from splitserve.planner.config import PlannerConfig
from splitserve.planner.law import Observation, Planner
from splitserve.planner.profile import CapacityProfile


def fixed(p, d):
    return lambda sim, t: {"prefill": p, "decode": d}


def planner_policy(cfg: PlannerConfig, profile: CapacityProfile, initial, rate_window_s: float = 60.0):
    """The planner fed like live: rates over the last `rate_window_s` (Prometheus rate[1m])."""
    planner = Planner(cfg, profile, initial={"prefill": initial[0], "decode": initial[1]})
    last = {"isl": 512.0, "osl": 128.0}
    recent = deque()  # (tick time, arrivals of that tick)

    def policy(sim, t: float):
        recent.append((t, [sim.trace[i] for i in sim.window]))
        while recent[0][0] <= t - rate_window_s:
            recent.popleft()
        span = min(rate_window_s, t)
        reqs = [r for _, batch in recent for r in batch]
        if reqs:
            last["isl"] = sum(r.prompt_tokens for r in reqs) / len(reqs)
            last["osl"] = sum(r.output_tokens for r in reqs) / len(reqs)
        obs = Observation(
            now=t,
            uncached_prompt_tokens_per_s=sum(r.prompt_tokens - r.cached_tokens for r in reqs) / span,
            output_tokens_per_s=sum(r.output_tokens for r in reqs) / span,
            prefill=sim.pool_obs("prefill", t),
            decode=sim.pool_obs("decode", t),
            mean_prompt_tokens=last["isl"],
            mean_output_tokens=last["osl"],
            inflight_decode_seqs=sum(len(r.seqs) for r in sim.pools["decode"]) + len(sim.dq),
            ttft_p90_s=_p90(sim.done_ttft),
            itl_p90_s=_p90(sim.done_itl),
        )
        return planner.tick(obs).desired()

    return policy


def queue_policy(threshold: float, lo: int, hi: int, window_s: float = 300.0):
    """KEDA on vllm:num_requests_waiting, AverageValue: HPA aims for ceil(sum / threshold),
    scales up at once (≤ doubling) and down to the highest recommendation of the last 300 s."""
    recs = {"prefill": deque(), "decode": deque()}

    def policy(sim, t: float):
        out = {}
        for pool, waiting in (("prefill", len(sim.pq)), ("decode", len(sim.dq))):
            cur = len([r for r in sim.pools[pool] if not r.draining])
            want = max(lo, min(hi, math.ceil(waiting / threshold), 2 * max(1, cur)))
            recs[pool].append((t, want))
            while recs[pool][0][0] < t - window_s:
                recs[pool].popleft()
            out[pool] = want if want >= cur else max(w for _, w in recs[pool])
        return out

    return policy


def _p90(xs):
    return sorted(xs)[int(0.9 * (len(xs) - 1))] if xs else None
