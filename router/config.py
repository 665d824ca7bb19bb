"""The router's settings: one frozen dataclass per concern, composed into `RouterConfig`.

A YAML (or JSON) file gives any subset of the keys below; command-line flags override it. Every
unknown key or bad value is a ConfigError that names the key and lists what is allowed. The
scorer weights live here (and in the file), never in the placement code. See docs/router.md for
the file format with every default.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import yaml

from splitserve.platform.errors import ConfigError
from splitserve.platform.model_source import DEFAULT_MODEL
from splitserve.router.flow.config import FlowControlConfig
from splitserve.router.flow.config import from_mapping as _flow_control

DISAGGREGATION_MODES = ("conditional", "always", "never")
INDEX_BACKENDS = ("memory", "redis")


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
    # the load scorers' saturation points, `balanced` keeps that true.
    return ProfileConfig(filters=("healthy", "not-draining", "not-saturated", "balanced"),
                         scorers=(ScorerSpec("prefix-overlap", 2.0), ScorerSpec("queue-depth", 3.0),
                                  ScorerSpec("kv-usage", 1.0), ScorerSpec("pending-assignments", 1.0),
                                  ScorerSpec("lora-affinity", 2.0)))


def default_prefill_profile() -> ProfileConfig:
    return ProfileConfig(filters=("healthy", "not-draining", "not-saturated"),
                         scorers=(ScorerSpec("prefix-overlap", 2.0), ScorerSpec("queued-prefill-tokens", 3.0),
                                  ScorerSpec("pending-assignments", 1.0)))


@dataclass(frozen=True)
class DisaggregationConfig:
    """`conditional`: a separate prefill only when the chosen decode worker would compute at least
    `min_prefill_tokens` uncached prompt tokens; `always` / `never` as named. The decode worker
    gets the best `max_prefill_candidates` prefill workers in order (it falls back down the list)."""

    mode: str = "conditional"
    min_prefill_tokens: int = 256
    max_prefill_candidates: int = 2

    def __post_init__(self) -> None:
        if self.mode not in DISAGGREGATION_MODES:
            raise ConfigError(f"disaggregation.mode={self.mode!r}; allowed: {', '.join(DISAGGREGATION_MODES)}")
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
    block_transfer_s: float = 0.005   # bench/w6_multiturn.py --probe-pull on a 2-vCPU host: 4-5.5 ms
    prefill_token_s: float = 0.003    # the same probe: SmolLM2-135M, 1 thread, 2.8 ms a token

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


@dataclass(frozen=True)
class IndexConfig:
    """The prefix index. `speculative_ttl_s`: how long a just-routed request's blocks count as
    cached on its workers before their KV events confirm them. `max_blocks_per_worker` bounds
    each worker's entries (least recently stored dropped first)."""

    backend: str = "memory"
    redis_url: str = ""
    key_prefix: str = "splitserve"
    speculative_ttl_s: float = 10.0
    max_blocks_per_worker: int = 262_144

    def __post_init__(self) -> None:
        if self.backend not in INDEX_BACKENDS:
            raise ConfigError(f"index.backend={self.backend!r}; allowed: {', '.join(INDEX_BACKENDS)}")
        if self.backend == "redis" and not self.redis_url:
            raise ConfigError("index.backend=redis needs index.redis_url (e.g. redis://127.0.0.1:6379/0)")
        if self.speculative_ttl_s < 0 or self.max_blocks_per_worker < 1:
            raise ConfigError("index.speculative_ttl_s must be >= 0 and index.max_blocks_per_worker >= 1")


@dataclass(frozen=True)
class DiscoveryConfig:
    """Static `workers` (gRPC host:port), or Kubernetes EndpointSlices of `k8s_services` (the pool
    Services' names) in `k8s_namespace`, using the EndpointSlice port named `k8s_port_name`.
    A worker that stops answering is retried after `backoff_initial_s`, doubling up to
    `backoff_max_s`; one silent for `stale_after_s` (no load report) counts as down."""

    workers: tuple[str, ...] = ()
    k8s_namespace: str = ""
    k8s_services: tuple[str, ...] = ()
    k8s_port_name: str = "grpc"
    backoff_initial_s: float = 0.25
    backoff_max_s: float = 5.0
    stale_after_s: float = 5.0
    tls_cert: str = ""
    """mTLS to the workers (platform/grpc_tls.py): this router's certificate, key and the CA (all three or none)."""
    tls_key: str = ""
    tls_ca: str = ""
    tls_server_name: str = ""
    """The name the workers' certificates carry (default splitserve-worker)."""

    def __post_init__(self) -> None:
        for address in self.workers:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"worker address {address!r} is invalid; allowed: host:port")
        if self.k8s_services and not self.k8s_namespace:
            raise ConfigError("discovery.k8s_services needs discovery.k8s_namespace")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s or self.stale_after_s <= 0:
            raise ConfigError("discovery: need 0 < backoff_initial_s <= backoff_max_s and stale_after_s > 0")


@dataclass(frozen=True)
class ApiKey:
    """An accepted API key; `name` labels it in logs and metrics (never the key itself); a
    `rate_per_s` / `burst` here override the global rate limit for this key. `models` (None: all),
    `rpm`, `tpm` and `monthly_tokens` scope and meter it (router/tenancy/; keys from
    `api_keys_file` come with key="" and their id as name)."""

    key: str
    name: str = ""
    rate_per_s: float | None = None
    burst: int | None = None
    models: tuple[str, ...] | None = None
    rpm: int | None = None
    tpm: int | None = None
    monthly_tokens: int | None = None
    max_concurrent: int | None = None
    priority: int | None = None      # flow-control band of the key's requests (router/flow/classify.py)
    weight: float | None = None      # the key's share in fair queuing (None: 1)


@dataclass(frozen=True)
class GatewayConfig:
    """The OpenAI gateway. `max_concurrent_requests` run at once, `max_queued_requests` more wait
    for a slot, anything beyond gets 429. Rate limits (token bucket, 0 = off) apply per API key
    (or to all callers together when no keys are configured), in Redis when `rate_limit_redis_url`
    is set (shared by router replicas) and in memory otherwise. A request that finds no worker able
    to take it waits up to `worker_wait_s` for one (startup, a pool momentarily empty) before its
    503 with Retry-After (router/core/readiness.py)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    api_keys: tuple[ApiKey, ...] = ()
    max_body_bytes: int = 8 * 1024 * 1024
    max_concurrent_requests: int = 256
    max_queued_requests: int = 1024
    rate_per_s: float = 0.0
    burst: int = 0
    rate_limit_redis_url: str = ""
    max_attempts: int = 3
    cold_start_hold_s: float = 0.0      # scale from zero: wait this long for a decode worker (0: off)
    cold_start_max_held: int = 64       # ...with at most this many requests waiting (router/core/hold.py)
    api_keys_file: str = ""
    """A YAML key file (router/tenancy/), reloaded on change; its keys add to `api_keys`."""
    quota_window_s: float = 60.0
    """The window of the per-key rpm / tpm limits (60: per minute, as OpenAI's)."""
    max_concurrent_per_key: int = 0
    """Requests one key may have in flight on one router (0: only max_concurrent_requests bounds them)."""
    tool_call_parser: str = "hermes"   # how `tool_choice: auto` answers are read: hermes | json
    worker_wait_s: float = 1.0          # a request finding no worker waits this long for one, then 503

    def __post_init__(self) -> None:
        if self.cold_start_hold_s < 0 or self.cold_start_max_held < 0:
            raise ConfigError(f"gateway: cold_start_hold_s={self.cold_start_hold_s} and cold_start_max_held="
                              f"{self.cold_start_max_held} must be >= 0 (0 s turns holding off)")
        if not isinstance(self.worker_wait_s, (int, float)) or not 0 <= self.worker_wait_s <= 600:
            raise ConfigError(f"gateway.worker_wait_s={self.worker_wait_s!r} is invalid; allowed: 0 to 600 seconds")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"gateway.port={self.port} is not a port; allowed: 0-65535")
        if self.max_body_bytes < 1024 or self.max_concurrent_requests < 1 or self.max_queued_requests < 0:
            raise ConfigError("gateway: need max_body_bytes >= 1024, max_concurrent_requests >= 1, "
                              "max_queued_requests >= 0")
        if self.tool_call_parser not in ("hermes", "json"):
            raise ConfigError(f"gateway.tool_call_parser={self.tool_call_parser!r} is unknown; allowed: hermes, json")
        if self.rate_per_s < 0 or self.burst < 0 or self.max_attempts < 1:
            raise ConfigError("gateway: need rate_per_s >= 0, burst >= 0 and max_attempts >= 1")
        if self.max_concurrent_per_key < 0:
            raise ConfigError(f"gateway.max_concurrent_per_key={self.max_concurrent_per_key}: need >= 0 (0 = off)")
        if not 0.1 <= self.quota_window_s <= 86400:
            raise ConfigError(f"gateway.quota_window_s={self.quota_window_s}: allowed 0.1-86400 seconds")


@dataclass(frozen=True)
class AdaptersConfig:
    """LoRA adapters declared in a file (router/placement/adapter_sync.py): `file` is a YAML list
    `adapters: [{name, path}]` that the router re-reads every `poll_s` and brings every worker in
    line with (load the missing, unload the rest); "" leaves adapters to the workers' flags and the
    load/unload API. With `report_configmap` (and `report_namespace`) set, the router writes what
    each pool has loaded into that ConfigMap's annotation `report_annotation` (the operator's
    status reads it)."""

    file: str = ""
    poll_s: float = 2.0
    report_namespace: str = ""
    report_configmap: str = ""
    report_annotation: str = "serving.splitserve.io/adapters-loaded"

    def __post_init__(self) -> None:
        if not isinstance(self.poll_s, (int, float)) or not 0.1 <= self.poll_s <= 300:
            raise ConfigError(f"adapters.poll_s={self.poll_s!r} is invalid; allowed: 0.1 to 300 seconds")
        if bool(self.report_configmap) != bool(self.report_namespace):
            raise ConfigError("adapters.report_configmap and adapters.report_namespace go together (both or neither)")
        if self.report_configmap and not self.file:
            raise ConfigError("adapters.report_configmap needs adapters.file (the report is of the declared adapters)")


@dataclass(frozen=True)
class RouterConfig:
    """`model` names the weights the workers serve (it seeds the block hashes, so it must be what
    the workers were started with); `max_model_len` bounds prompt + completion tokens."""

    model: str = DEFAULT_MODEL
    max_model_len: int = 2048
    block_size: int = 16
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    adapters: AdaptersConfig = field(default_factory=AdaptersConfig)
    flow_control: FlowControlConfig = field(default_factory=FlowControlConfig)

    def __post_init__(self) -> None:
        if self.max_model_len < 2 or self.block_size < 1:
            raise ConfigError(f"max_model_len={self.max_model_len} must be >= 2 and block_size={self.block_size} >= 1")

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return self.gateway.served_model_names or (self.model,)


def load_config(path: str | None = None, **overrides) -> RouterConfig:
    """The file's settings (YAML or JSON; none: defaults) with `overrides` applied on top.
    Overrides use dotted section names: load_config(p, **{"gateway.port": 8001})."""
    data: dict = {}
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"router config file {path} does not exist")
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the router config must be a mapping, got {type(data).__name__}")
    for dotted, value in overrides.items():
        if value is None:
            continue
        *sections, key = dotted.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
        node[key] = value
    return from_dict(data)


def from_dict(data: dict) -> RouterConfig:
    sections = {"gateway": _gateway, "discovery": _discovery, "index": _index, "placement": _placement,
                "adapters": lambda d: AdaptersConfig(**checked_mapping(d, AdaptersConfig, "adapters")),
                "flow_control": _flow_control}
    kwargs = {}
    for key, value in checked_mapping(data, RouterConfig, "").items():
        kwargs[key] = sections[key](value) if key in sections else value
    return RouterConfig(**kwargs)


def checked_mapping(data, cls, where: str) -> dict:
    """`data` if it is a mapping whose keys are all fields of the dataclass `cls`; otherwise a
    ConfigError naming `where`, the unknown keys and the allowed ones. Also used by rayserve/config.py."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'router config'} must be a mapping, got {type(data).__name__}")
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where or 'the router config'}; allowed: {', '.join(allowed)}")
    return data


def _tuple_fields(data: dict, *names: str) -> dict:
    out = dict(data)
    for name in names:
        if name in out:
            value = out[name]
            out[name] = tuple(value.split(",") if isinstance(value, str) else value)
    return out


def _gateway(data) -> GatewayConfig:
    data = _tuple_fields(checked_mapping(data, GatewayConfig, "gateway"), "served_model_names")
    keys = data.get("api_keys", ())
    if isinstance(keys, str):
        keys = [k for k in keys.split(",") if k]
    data["api_keys"] = tuple(ApiKey(**_tuple_fields(checked_mapping(k, ApiKey, "gateway.api_keys[]"), "models"))
                             if isinstance(k, dict)
                             else ApiKey(key=str(k)) for k in keys)
    return GatewayConfig(**data)


def _discovery(data) -> DiscoveryConfig:
    return DiscoveryConfig(**_tuple_fields(checked_mapping(data, DiscoveryConfig, "discovery"),
                                           "workers", "k8s_services"))


def _index(data) -> IndexConfig:
    data = dict(checked_mapping(data, IndexConfig, "index"))
    if data.get("redis_url"):
        data["redis_url"] = with_password(data["redis_url"], os.environ.get("REDIS_PASSWORD", ""))
    return IndexConfig(**data)


def with_password(url: str, password: str) -> str:
    """Put REDIS_PASSWORD (the operator mounts it from a Secret) into a redis URL that has none,
    so the password never sits in the ConfigMap."""
    scheme, sep, rest = url.partition("://")
    if not password or not sep or "@" in rest:
        return url
    from urllib.parse import quote
    return f"{scheme}://:{quote(password, safe='')}@{rest}"


def _placement(data) -> PlacementConfig:
    data = checked_mapping(data, PlacementConfig, "placement")
    kwargs = {}
    if "disaggregation" in data:
        kwargs["disaggregation"] = DisaggregationConfig(**checked_mapping(data["disaggregation"], DisaggregationConfig,
                                                                   "placement.disaggregation"))
    if "kv_pull" in data:
        kwargs["kv_pull"] = KVPullConfig(**checked_mapping(data["kv_pull"], KVPullConfig, "placement.kv_pull"))
    for role, default in (("decode", default_decode_profile()), ("prefill", default_prefill_profile())):
        if role in data:
            kwargs[role] = _profile(data[role], default, f"placement.{role}")
    return PlacementConfig(**kwargs)


def _profile(data, default: ProfileConfig, where: str) -> ProfileConfig:
    data = checked_mapping(data, ProfileConfig, where)
    scorers = default.scorers
    if "scorers" in data:
        if not isinstance(data["scorers"], list):
            raise ConfigError(f"{where}.scorers must be a list of {{name, weight, params}}")
        scorers = tuple(ScorerSpec(**checked_mapping(s, ScorerSpec, f"{where}.scorers[]")) for s in data["scorers"])
    return ProfileConfig(filters=tuple(data.get("filters", default.filters)), scorers=scorers,
                         filter_params=dict(data.get("filter_params", default.filter_params)))
