"""The control law: one tick's observation in, desired prefill and decode replicas out.

Per pool p (prefill: demand = uncached prompt tokens/s, latency = TTFT p90 without the KV
transfer; decode: demand = output tokens/s, latency = ITL p90):

1. Feed-forward.  need(λ) = ceil(λ·(1 + headroom) / (μ·utilization)), μ = one replica's
   profiled tokens/s (prefill at the mean prompt length; decode at the best concurrency that
   meets the ITL target, at the mean context), corrected online (capacity.py). Decode also
   needs ceil(in-flight seqs · mean context / (kv_tokens · kv_utilization)) replicas for KV.
   Scale-up reads the peak demand of the last `peak_window_s`; scale-down reads an EWMA, so
   the pool grows on the first sign of load and shrinks only on a sustained fall.
2. Feedback trim.  +1 replica while the measured latency misses the SLO. It is bounded to one
   replica on purpose: a latency spike right after a load step would otherwise multiply the
   step (overshoot), and a persistent capacity error is the online correction's job.
3. Up fast.  At most doubling per tick. While pods of the pool are Pending no further replica
   is asked for; once a pod has been Pending longer than `pending_timeout_s` (no room in the
   cluster) the target is cut to ready + 1, so a full cluster never collects a queue of
   Pending pods and the planner keeps deciding (Dynamo #14251 froze waiting on one).
4. Down slow.  One replica per tick, only after the smoothed need has stayed below the target
   for `scale_down_window_s`, and only if the survivors would run below `down_threshold` of
   their capacity (consolidation check; without it a pool at 0.7 load flaps 2↔1, Dynamo
   PR #9294). Up needs load > utilization per replica, down needs the survivors < down_threshold
   (both with headroom): the dead band between keeps noise around a constant load from
   crossing both thresholds.
   Requests held in the gateways' flow-control queues have reached no worker, so no token
   rate shows them: each adds its mean prompt and output tokens, spread over
   `queue_drain_s`, to the pools' demand. A pool at zero replicas with a queue therefore asks
   for one (scale from zero while requests wait, bounded, in the gateway).
5. Missing metrics hold the last target (no sample is not the same as no load: Dynamo #6985
   never drained because NaN skipped the tick, so zero traffic is an explicit zero here and a
   full peak window of zeros drains to the floor at one replica per tick after the window).
6. Bounds: each pool within [min, max]; both within the replica budget, split in proportion to
   the pools' needs (Dynamo's budget rule).

Every decision carries its inputs and a reason, which the planner exports on /metrics.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from splitserve.planner.capacity import OnlineCapacity, ReplicaSample
from splitserve.planner.config import POOLS, PlannerConfig
from splitserve.planner.profile import CapacityProfile

REASONS = (
    "hold",
    "scale_up",
    "scale_down",
    "hold_missing_metrics",
    "wait_scale_down_window",
    "hold_survivors_would_not_fit",
    "wait_pending",
    "capped_pending",
    "capped_budget",
    "raise_to_min",
    "cap_at_max",
)


@dataclass(frozen=True)
class PoolObservation:
    """Replicas of one pool as the cluster reports them."""

    ready: int
    pending: int = 0
    oldest_pending_s: float = 0.0


@dataclass(frozen=True)
class Observation:
    """One tick's inputs. A rate of None means the metrics could not be read (hold)."""

    now: float
    uncached_prompt_tokens_per_s: float | None
    output_tokens_per_s: float | None
    prefill: PoolObservation
    decode: PoolObservation
    mean_prompt_tokens: float = 512.0
    mean_output_tokens: float = 128.0
    inflight_decode_seqs: float = 0.0
    queued_requests: float = 0.0  # in the gateways' flow-control queues
    ttft_p90_s: float | None = None  # prefill's share: TTFT minus KV transfer
    itl_p90_s: float | None = None
    samples: tuple[ReplicaSample, ...] = ()


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    desired: int
    reason: str
    demand: float | None
    capacity: float
    need: int
    trim: int


@dataclass(frozen=True)
class Decision:
    prefill: PoolDecision
    decode: PoolDecision

    def desired(self) -> dict[str, int]:
        return {"prefill": self.prefill.desired, "decode": self.decode.desired}


@dataclass
class _PoolState:
    target: int
    peak: deque = field(default_factory=deque)  # (t, demand) within peak_window_s
    ewma: float | None = None
    below_since: float | None = None


class Planner:
    """Holds the per-pool state between ticks; `tick` is the only mutator."""

    def __init__(self, cfg: PlannerConfig, profile: CapacityProfile, initial: dict[str, int] | None = None) -> None:
        self.cfg, self.profile = cfg, profile
        self.online = OnlineCapacity(cfg.warmup_s)
        initial = initial or {}
        self._state = {p: _PoolState(target=initial.get(p, cfg.bounds(p).min_replicas)) for p in POOLS}

    def targets(self) -> dict[str, int]:
        return {p: s.target for p, s in self._state.items()}

    def tick(self, obs: Observation) -> Decision:
        self.online.observe(list(obs.samples))
        ctx = obs.mean_prompt_tokens + obs.mean_output_tokens / 2
        mu_p = self.online.capacity("prefill", self.profile.prefill_tokens_per_s(obs.mean_prompt_tokens))
        mu_d = self.online.capacity("decode", self.profile.decode_tokens_per_s(self.cfg.itl_p90_s, ctx))
        kv_need = math.ceil(obs.inflight_decode_seqs * ctx / (self.profile.kv_tokens * self.cfg.kv_utilization) - 1e-9)
        p = self._pool(
            "prefill",
            obs.now,
            self._with_queue(obs.uncached_prompt_tokens_per_s, obs.queued_requests, obs.mean_prompt_tokens),
            mu_p,
            0,
            obs.ttft_p90_s,
            self.cfg.ttft_p90_s,
            obs.prefill,
        )
        d = self._pool(
            "decode",
            obs.now,
            self._with_queue(obs.output_tokens_per_s, obs.queued_requests, obs.mean_output_tokens),
            mu_d,
            kv_need,
            obs.itl_p90_s,
            self.cfg.itl_p90_s,
            obs.decode,
        )
        p, d = self._budget(p, d)
        self._state["prefill"].target, self._state["decode"].target = p.desired, d.desired
        return Decision(prefill=p, decode=d)

    # -- one pool ------------------------------------------------------------------------------

    def _with_queue(self, rate: float | None, queued: float, tokens_per_request: float) -> float | None:
        """A pool's demand plus the gateway queue's tokens spread over queue_drain_s (rule 1)."""
        if rate is None:
            return None
        return rate + max(0.0, queued) * tokens_per_request / self.cfg.queue_drain_s

    def _need(self, demand: float, mu: float, floor: int) -> int:
        return max(floor, math.ceil(demand * (1 + self.cfg.headroom) / (mu * self.cfg.utilization) - 1e-9))

    def _pool(
        self,
        pool: str,
        now: float,
        demand: float | None,
        mu: float,
        kv_need: int,
        latency: float | None,
        slo: float,
        obs: PoolObservation,
    ) -> PoolDecision:
        st, cfg, bounds = self._state[pool], self.cfg, self.cfg.bounds(pool)
        current = st.target
        if demand is None:
            return PoolDecision(pool, current, "hold_missing_metrics", None, mu, current, 0)
        st.peak.append((now, demand))
        while st.peak and st.peak[0][0] < now - cfg.peak_window_s:
            st.peak.popleft()
        peak = max(d for _, d in st.peak)
        st.ewma = (
            0.0
            if peak == 0
            else demand
            if st.ewma is None
            else cfg.ewma_alpha * demand + (1 - cfg.ewma_alpha) * st.ewma
        )
        trim = 1 if latency is not None and latency > slo and demand > 0 else 0
        need_up = self._need(peak, mu, kv_need) + trim
        need_down = self._need(st.ewma, mu, kv_need) + trim
        stuck = obs.pending > 0 and obs.oldest_pending_s >= cfg.pending_timeout_s
        if need_up > current:
            st.below_since = None
            if obs.pending > 0:
                desired, reason = current, "wait_pending"
            else:
                desired, reason = min(need_up, current + max(1, current)), "scale_up"
        elif need_down < current:
            desired, reason = self._down(st, now, current, mu, kv_need)
        else:
            st.below_since = None
            desired, reason = current, "hold"
        if stuck and desired > obs.ready + 1:
            desired, reason = obs.ready + 1, "capped_pending"
        if desired < bounds.min_replicas:
            desired, reason = bounds.min_replicas, "raise_to_min"
        elif desired > bounds.max_replicas:
            desired, reason = bounds.max_replicas, "cap_at_max"
        return PoolDecision(pool, desired, reason, demand, mu, max(need_up, kv_need), trim)

    def _down(self, st: _PoolState, now: float, current: int, mu: float, kv_need: int) -> tuple[int, str]:
        if st.below_since is None:
            st.below_since = now
        if now - st.below_since < self.cfg.scale_down_window_s:
            return current, "wait_scale_down_window"
        survivors = current - 1
        if survivors == 0:
            fits = st.ewma == 0 and kv_need == 0
        else:
            fits = (
                st.ewma * (1 + self.cfg.headroom) / (mu * survivors) < self.cfg.down_threshold and kv_need <= survivors
            )
        return (survivors, "scale_down") if fits else (current, "hold_survivors_would_not_fit")

    # -- both pools ----------------------------------------------------------------------------

    def _budget(self, p: PoolDecision, d: PoolDecision) -> tuple[PoolDecision, PoolDecision]:
        budget = self.cfg.budget
        if not budget or p.desired + d.desired <= budget:
            return p, d
        lo_p, lo_d = self.cfg.prefill.min_replicas, self.cfg.decode.min_replicas
        want_p, want_d = max(p.need, p.desired), max(d.need, d.desired)
        n_p = max(lo_p, min(p.desired, round(budget * want_p / (want_p + want_d))))
        n_d = max(lo_d, min(d.desired, budget - n_p))
        n_p = min(n_p, budget - n_d)
        return (
            PoolDecision(
                p.pool, n_p, "capped_budget" if n_p < p.desired else p.reason, p.demand, p.capacity, p.need, p.trim
            ),
            PoolDecision(
                d.pool, n_d, "capped_budget" if n_d < d.desired else d.reason, d.demand, d.capacity, d.need, d.trim
            ),
        )
