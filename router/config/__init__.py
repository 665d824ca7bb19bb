"""The router's settings: one frozen dataclass per concern, composed into `RouterConfig`.

A YAML (or JSON) file gives any subset of the keys below; command-line flags override it. Every
unknown key or bad value is a ConfigError that names the key and lists what is allowed
(config/file.py reads the file into these). The `placement:` section's dataclasses, with the
scorer weights, live in config/placement.py (importable from here too) and the `flow_control:`
section in config/flow.py: the settings sit at the router's bottom, beside its errors, so every
folder that reads them (placement/, flow/, tenancy/, core/) is above them, and the weights live in
the config and the file, never in the placement code. See docs/router.md for the file format with
every default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.platform.errors import ConfigError
from splitserve.platform.model_source import DEFAULT_MODEL
from splitserve.router.config.flow import FlowControlConfig
from splitserve.router.config.placement import DISAGGREGATION_MODES as DISAGGREGATION_MODES
from splitserve.router.config.placement import DisaggregationConfig as DisaggregationConfig
from splitserve.router.config.placement import KVPullConfig as KVPullConfig
from splitserve.router.config.placement import PlacementConfig, check_choice
from splitserve.router.config.placement import ProfileConfig as ProfileConfig
from splitserve.router.config.placement import ScorerSpec as ScorerSpec
from splitserve.router.config.placement import default_decode_profile as default_decode_profile
from splitserve.router.config.placement import default_prefill_profile as default_prefill_profile

INDEX_BACKENDS = ("memory", "redis")


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
        check_choice("index.backend", self.backend, INDEX_BACKENDS)
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
    """mTLS to the workers (platform/wire/grpc_tls.py): this router's certificate, key and CA (all three or none)."""
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


KEY_ROLES = ("user", "admin", "metrics")
"""`user` calls the /v1 API; `admin` also loads LoRA adapters and reads /metrics; `metrics` (a
scraper) reads /metrics and nothing else."""


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
    role: str = "user"
    """`admin` may also load and unload LoRA adapters at run time and read /metrics; `user` (the
    default) may not; `metrics` may only read /metrics (KEY_ROLES)."""
    priority: int | None = None  # flow-control band of the key's requests (router/flow/classify.py)
    weight: float | None = None  # the key's share in fair queuing (None: 1)
    max_priority: int | None = None
    """The highest band an objective header may raise the key's requests to (None: its own band)."""
    min_request_priority: int = 0
    """The lowest body `priority` the key's requests keep (lower first in the engine): a lower one is
    raised to it, so by default a tenant can only put its own requests later, never ahead of others'."""

    def __post_init__(self) -> None:
        if self.role not in KEY_ROLES:
            raise ConfigError(
                f"API key {self.name or '(unnamed)'}: role={self.role!r} is unknown; allowed: {', '.join(KEY_ROLES)}"
            )


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
    cold_start_hold_s: float = 0.0  # scale from zero: wait this long for a decode worker (0: off)
    cold_start_max_held: int = 64  # ...with at most this many requests waiting (router/core/hold.py)
    api_keys_file: str = ""
    """A YAML key file (router/tenancy/), reloaded on change; its keys add to `api_keys`."""
    quota_window_s: float = 60.0
    """The window of the per-key rpm / tpm limits (60: per minute, as OpenAI's)."""
    max_concurrent_per_key: int = 0
    """Requests one key may have in flight on one router (0: only max_concurrent_requests bounds them)."""
    tool_call_parser: str = "hermes"  # how `tool_choice: auto` answers are read: hermes | json
    worker_wait_s: float = 1.0  # a request finding no worker waits this long for one, then 503
    lora_roots: tuple[str, ...] = ()
    """Folders runtime LoRA loads may read from (`--lora-roots`): a `lora_path` elsewhere is 403. Empty:
    with API keys configured no runtime load is allowed; without keys (an open gateway) any path is."""
    public_metrics: bool = False
    """Serve /metrics on the gateway port without a key even when keys are configured (default: it needs
    one; the `--metrics-port` scrape port is separate and open, for Prometheus behind a NetworkPolicy)."""
    max_choices_per_request: int = 1024
    """Prompts x n of one completions request (each becomes a job); more is a 400 before anything is built."""
    max_prompt_tokens_per_request: int = 1 << 20
    """Prompt tokens of one request summed over its prompts; more is a 400 before any job is built."""
    max_tokenize_chars: int = 1 << 20
    """Characters one /tokenize call may send (its prompt, or its messages' contents); more is a 400."""
    public_docs: bool = False
    """Serve /docs and /openapi.json without a key even when keys are configured (default: they need one)."""
    num_processes: int = 1
    """How many gateway processes answer the API with these keys together: router replicas, and
    behind an inference gateway the EPP and each decode pod's sidecar (the operator renders it). Above
    1, keys with rpm, tpm or monthly_tokens need `rate_limit_redis_url`, or each process would count
    them alone: the router refuses to start (router/config/keys.py, check_shared_quotas)."""

    def __post_init__(self) -> None:
        if self.cold_start_hold_s < 0 or self.cold_start_max_held < 0:
            raise ConfigError(
                f"gateway: cold_start_hold_s={self.cold_start_hold_s} and cold_start_max_held="
                f"{self.cold_start_max_held} must be >= 0 (0 s turns holding off)"
            )
        if not isinstance(self.worker_wait_s, (int, float)) or not 0 <= self.worker_wait_s <= 600:
            raise ConfigError(f"gateway.worker_wait_s={self.worker_wait_s!r} is invalid; allowed: 0 to 600 seconds")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"gateway.port={self.port} is not a port; allowed: 0-65535")
        if self.max_body_bytes < 1024 or self.max_concurrent_requests < 1 or self.max_queued_requests < 0:
            raise ConfigError(
                "gateway: need max_body_bytes >= 1024, max_concurrent_requests >= 1, max_queued_requests >= 0"
            )
        if self.tool_call_parser not in ("hermes", "json"):
            raise ConfigError(f"gateway.tool_call_parser={self.tool_call_parser!r} is unknown; allowed: hermes, json")
        if self.rate_per_s < 0 or self.burst < 0 or self.max_attempts < 1:
            raise ConfigError("gateway: need rate_per_s >= 0, burst >= 0 and max_attempts >= 1")
        if self.max_concurrent_per_key < 0:
            raise ConfigError(f"gateway.max_concurrent_per_key={self.max_concurrent_per_key}: need >= 0 (0 = off)")
        if not 0.1 <= self.quota_window_s <= 86400:
            raise ConfigError(f"gateway.quota_window_s={self.quota_window_s}: allowed 0.1-86400 seconds")
        for name in ("max_choices_per_request", "max_prompt_tokens_per_request", "max_tokenize_chars"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"gateway.{name}={getattr(self, name)!r}: need a positive integer")
        if not isinstance(self.num_processes, int) or isinstance(self.num_processes, bool) or self.num_processes < 1:
            raise ConfigError(f"gateway.num_processes={self.num_processes!r}: need a positive integer (1: this one)")
        if any(not root.startswith("/") for root in self.lora_roots):
            raise ConfigError(f"gateway.lora_roots={list(self.lora_roots)}: need absolute folders (--lora-roots)")


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
