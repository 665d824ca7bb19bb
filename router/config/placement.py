"""Where requests are placed: the placement profiles (filters, weighted scorers), disaggregation
and KV pulls; the `placement:` section of the router config (config/__init__.py composes it,
config/file.py reads it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.platform.errors import ConfigError

DISAGGREGATION_MODES = ("conditional", "always", "never")


def check_choice(key: str, value, allowed: tuple[str, ...]) -> None:
    """A ConfigError naming `key` and listing the allowed values unless `value` is one of them."""
    if value not in allowed:
        raise ConfigError(f"{key}={value!r}; allowed: {', '.join(allowed)}")


@dataclass(frozen=True)
class ScorerSpec:
    """One scorer of a placement profile: its registered `name`, its `weight` in the weighted sum
    (>= 0; 0 turns it off) and its `params` (parsed by the scorer itself over its defaults)."""

    name: str
    weight: float = 1.0
    params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.weight, (int, float)) or self.weight < 0:
            raise ConfigError(f"scorer {self.name!r}: weight={self.weight!r} is invalid; allowed: a number >= 0")


@dataclass(frozen=True)
class ProfileConfig:
    """How one role is placed: filters in order, then the weighted scorers."""

    filters: tuple[str, ...]
    scorers: tuple[ScorerSpec, ...]
    filter_params: dict = field(default_factory=dict)


def default_decode_profile() -> ProfileConfig:
    # Load outweighs a prefix hit once a worker's queue is much deeper (docs/router.md); past
    # the load scorers' saturation points, `balanced` keeps that true. cache-room spreads prompts
    # no worker holds over the emptier caches; a full hit plus its weight (2 + 0.5) stays below a
    # saturated queue's 3.
    return ProfileConfig(
        filters=("healthy", "not-draining", "not-saturated", "balanced"),
        scorers=(
            ScorerSpec("prefix-overlap", 2.0),
            ScorerSpec("queue-depth", 3.0),
            ScorerSpec("kv-usage", 1.0),
            ScorerSpec("cache-room", 0.5),
            ScorerSpec("pending-assignments", 1.0),
            ScorerSpec("lora-affinity", 2.0),
        ),
    )


def default_prefill_profile() -> ProfileConfig:
    return ProfileConfig(
        filters=("healthy", "not-draining", "not-saturated"),
        scorers=(
            ScorerSpec("prefix-overlap", 2.0),
            ScorerSpec("queued-prefill-tokens", 3.0),
            ScorerSpec("pending-assignments", 1.0),
        ),
    )


@dataclass(frozen=True)
class DisaggregationConfig:
    """`conditional`: a separate prefill only when the chosen decode worker would compute at least
    `min_prefill_tokens` uncached prompt tokens; `always` / `never` as named. The decode worker
    gets the best `max_prefill_candidates` prefill workers in order (it falls back down the list)."""

    mode: str = "conditional"
    min_prefill_tokens: int = 256
    max_prefill_candidates: int = 2

    def __post_init__(self) -> None:
        check_choice("disaggregation.mode", self.mode, DISAGGREGATION_MODES)
        if self.min_prefill_tokens < 0 or self.max_prefill_candidates < 1:
            raise ConfigError("disaggregation.min_prefill_tokens must be >= 0 and max_prefill_candidates >= 1")


@dataclass(frozen=True)
class KVPullConfig:
    """Pull instead of recompute (router/placement/pull_cost.py, docs/kv-tiers.md). When the chosen worker
    lacks at least `min_blocks` more of the prompt's prefix than another healthy worker holds,
    the request carries that holder, if pulling the difference is estimated cheaper than
    computing it. `block_transfer_s` and `prefill_token_s` are the starting estimates (seconds
    per pulled block, per computed prompt token); observed pulls and prefills refine them."""

    enabled: bool = True
    min_blocks: int = 2
    block_transfer_s: float = 0.005  # bench/w6_multiturn.py --probe-pull on a 2-vCPU host: 4-5.5 ms
    prefill_token_s: float = 0.003  # the same probe: SmolLM2-135M, 1 thread, 2.8 ms a token

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"placement.kv_pull.enabled must be true or false, got {self.enabled!r}")
        if self.min_blocks < 1:
            raise ConfigError(f"placement.kv_pull.min_blocks must be >= 1, got {self.min_blocks}")
        if self.block_transfer_s <= 0 or self.prefill_token_s <= 0:
            raise ConfigError("placement.kv_pull.block_transfer_s and prefill_token_s must be > 0 (seconds)")


@dataclass(frozen=True)
class PlacementConfig:
    decode: ProfileConfig = field(default_factory=default_decode_profile)
    prefill: ProfileConfig = field(default_factory=default_prefill_profile)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    kv_pull: KVPullConfig = field(default_factory=KVPullConfig)
