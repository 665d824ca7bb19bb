"""Flow-control settings (one frozen dataclass, validated where declared).

The names follow the Gateway API Inference Extension (GIE) where it has one: an *objective*
(GIE's InferenceObjective) names a priority band; a negative band is *sheddable*; the flow (the
tenant) is read from the `x-gateway-inference-fairness-id` header; the *saturation detector*
thresholds are GIE's `queueDepthThreshold` and `kvCacheUtilThreshold`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from splitserve.platform.errors import ConfigError

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
MAX_BAND = 1_000_000


def _number(value, where: str, low: float, high: float, integer: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = isinstance(value, int)
    if not ok or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"flow_control.{where}={value!r} is invalid; allowed: {kind} from {low} to {high}")


@dataclass(frozen=True)
class FlowControlConfig:
    """Flow control at the gateway (router/flow/). `enabled`: None (the default) turns it on when
    the key file gives a key a `priority`, `max_priority` or `weight` (router/config/file.py), so
    a priority never silently does nothing; off, every admitted request is dispatched at once.

    - `objectives`: objective name -> band (an integer; higher is more important, negative is
      sheddable). A request names one in the `objective_header`; `default_objectives` maps a
      served model (or adapter) name to the objective its requests get without the header.
    - `fairness_header`: the flow (tenant) id; absent, the API key's id, else the client address.
    - `max_queued_per_band` / `max_queue_wait_s`: the bounds of each band's queue; past either,
      503 (saturated) or 429 (the flow is over its share of a full queue), with Retry-After.
    - The saturation detector: a decode worker is full when its waiting requests reach
      `queue_depth_threshold`, its KV use `kv_cache_threshold`, or (when > 0) its running
      requests `max_running_per_worker`; its load report older than `load_staleness_s` counts as
      full. The pool is saturated when every healthy decode worker is full.
    - With `max_running_per_worker` 0 and `latency_cap` on (the default), each worker's running
      cap is derived from the step time the router measures there (router/flow/latency.py): the
      largest batch whose step stays within `(1 + latency_slack)` of a lone request's step, or
      within `itl_target_s` seconds when that is set.
    - `reserved_running`: of `max_running_per_worker`, the slots per worker that only requests of
      band >= `reserved_min_band` may take, so an interactive band starts without waiting for a
      batch job's request to end.
    """

    enabled: bool | None = None
    objectives: dict[str, int] = field(default_factory=dict)
    default_objectives: dict[str, str] = field(default_factory=dict)
    fairness_header: str = FAIRNESS_HEADER
    objective_header: str = OBJECTIVE_HEADER
    max_queued_per_band: int = 256
    max_queue_wait_s: float = 30.0
    queue_depth_threshold: int = 5
    kv_cache_threshold: float = 0.8
    max_running_per_worker: int = 0
    reserved_running: int = 0
    reserved_min_band: int = 1
    latency_cap: bool = True
    latency_slack: float = 0.5
    itl_target_s: float = 0.0
    load_staleness_s: float = 5.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.objectives, dict):
            raise ConfigError("flow_control.objectives must be a mapping {name: band}")
        for name, band in self.objectives.items():
            if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
                raise ConfigError(
                    f"flow_control.objectives: {name!r} is not a valid name; allowed: 1-63 letters, "
                    "digits, '.', '_' or '-', starting with a letter or digit"
                )
            _number(band, f"objectives.{name}", -MAX_BAND, MAX_BAND, integer=True)
        if not isinstance(self.default_objectives, dict):
            raise ConfigError("flow_control.default_objectives must be a mapping {model: objective}")
        for model, objective in self.default_objectives.items():
            if objective not in self.objectives:
                raise ConfigError(
                    f"flow_control.default_objectives.{model}={objective!r} is not an objective; "
                    f"allowed: {', '.join(sorted(self.objectives)) or 'none are declared'}"
                )
        for name in ("fairness_header", "objective_header"):
            value = getattr(self, name)
            if not isinstance(value, str) or not re.fullmatch(r"[a-z0-9-]{1,64}", value):
                raise ConfigError(f"flow_control.{name}={value!r} is invalid; allowed: a lower-case header name")
        _number(self.max_queued_per_band, "max_queued_per_band", 0, 1_000_000, integer=True)
        _number(self.max_queue_wait_s, "max_queue_wait_s", 0, 3600)
        _number(self.queue_depth_threshold, "queue_depth_threshold", 1, 1_000_000, integer=True)
        _number(self.kv_cache_threshold, "kv_cache_threshold", 0.01, 1.0)
        _number(self.max_running_per_worker, "max_running_per_worker", 0, 1_000_000, integer=True)
        _number(self.reserved_running, "reserved_running", 0, 1_000_000, integer=True)
        _number(self.reserved_min_band, "reserved_min_band", -MAX_BAND, MAX_BAND, integer=True)
        _number(self.latency_slack, "latency_slack", 0.01, 100)
        _number(self.itl_target_s, "itl_target_s", 0, 60)
        if self.enabled not in (None, True, False):
            raise ConfigError(f"flow_control.enabled={self.enabled!r} is invalid; allowed: true, false or unset")
        if not isinstance(self.latency_cap, bool):
            raise ConfigError(f"flow_control.latency_cap={self.latency_cap!r} is invalid; allowed: true or false")
        _number(self.load_staleness_s, "load_staleness_s", 0.1, 3600)
        _number(self.retry_after_s, "retry_after_s", 1, 3600, integer=True)
        if self.reserved_running and self.reserved_running >= self.max_running_per_worker:
            raise ConfigError(
                f"flow_control.reserved_running={self.reserved_running} needs max_running_per_worker "
                f"above it (now {self.max_running_per_worker})"
            )

    @property
    def is_latency_capped(self) -> bool:
        """The running cap per worker comes from its measured step time (router/flow/latency.py)."""
        return self.latency_cap and not self.max_running_per_worker

    def running_limit(self, band: int) -> int:
        """Running requests per worker that a request of `band` may dispatch beside (0: no limit
        set; see is_latency_capped)."""
        if not self.max_running_per_worker:
            return 0
        return self.max_running_per_worker - (self.reserved_running if band < self.reserved_min_band else 0)


def from_mapping(data) -> FlowControlConfig:
    """The config of a YAML mapping (the router config's `flow_control:` section)."""
    if not isinstance(data, dict):
        raise ConfigError(f"flow_control must be a mapping, got {type(data).__name__}")
    allowed = set(FlowControlConfig.__dataclass_fields__)
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in flow_control; allowed: {', '.join(sorted(allowed))}")
    return FlowControlConfig(**data)
