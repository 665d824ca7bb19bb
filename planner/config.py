"""The planner's knobs: one frozen dataclass, validated where declared."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.platform.errors import ConfigError

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class PoolBounds:
    """Replica floor and ceiling of one pool. The floor may be 0 only with the router's
    scale-from-zero hold in front of the pool (the first request is the demand signal)."""

    min_replicas: int = 1
    max_replicas: int = 8

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise ConfigError(f"min_replicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas < max(1, self.min_replicas):
            raise ConfigError(
                f"max_replicas must be >= max(1, min_replicas={self.min_replicas}), got {self.max_replicas}"
            )


@dataclass(frozen=True)
class PlannerConfig:
    """Latency targets and control-law knobs (see law.py for how each is used).

    ttft_p90_s / itl_p90_s: the SLO. tick_s: decision period. headroom: extra demand provisioned
    for (0.1 = 10 %). utilization: the fraction of profiled capacity a replica is planned to run at.
    kv_utilization: the same for decode KV blocks. down_threshold: a pool shrinks only if the
    survivors would run below this fraction of capacity. scale_down_window_s: demand must have
    wanted fewer replicas for this long before one is removed. peak_window_s: scale-up reads the
    peak demand of this window. ewma_alpha: smoothing of the scale-down demand. pending_timeout_s:
    a pod Pending longer is stuck. warmup_s: a replica's throughput is not trusted before this age.
    budget: total replicas of both pools (0 = only the per-pool ceilings). queue_drain_s: requests
    waiting in the gateways' flow-control queues count as demand to serve within this long.
    """

    ttft_p90_s: float = 2.0
    itl_p90_s: float = 0.1
    tick_s: float = 15.0
    headroom: float = 0.1
    utilization: float = 0.8
    kv_utilization: float = 0.8
    down_threshold: float = 0.7
    scale_down_window_s: float = 300.0
    peak_window_s: float = 60.0
    ewma_alpha: float = 0.3
    pending_timeout_s: float = 120.0
    warmup_s: float = 60.0
    budget: int = 0
    queue_drain_s: float = 30.0
    prefill: PoolBounds = PoolBounds()
    decode: PoolBounds = PoolBounds()

    def __post_init__(self) -> None:
        for name in ("ttft_p90_s", "itl_p90_s", "tick_s", "queue_drain_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"planner {name} must be > 0, got {getattr(self, name)}")
        for name in ("utilization", "kv_utilization", "down_threshold", "ewma_alpha"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ConfigError(f"planner {name} must be in (0, 1], got {v}")
        if not 0 <= self.headroom <= 4:
            raise ConfigError(f"planner headroom must be in [0, 4], got {self.headroom}")
        if self.down_threshold > self.utilization:
            raise ConfigError(
                f"planner down_threshold ({self.down_threshold}) must be <= utilization "
                f"({self.utilization}), or a pool would shrink into a scale-up"
            )
        for name in ("scale_down_window_s", "peak_window_s", "pending_timeout_s", "warmup_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"planner {name} must be >= 0, got {getattr(self, name)}")
        floor = self.prefill.min_replicas + self.decode.min_replicas
        if self.budget < 0 or (self.budget and self.budget < max(floor, 2)):
            raise ConfigError(
                f"planner budget must be 0 (none) or >= the pools' floors ({max(floor, 2)}), got {self.budget}"
            )

    def bounds(self, pool: str) -> PoolBounds:
        if pool not in POOLS:
            raise ConfigError(f"unknown pool {pool!r}; allowed: {', '.join(POOLS)}")
        return getattr(self, pool)
