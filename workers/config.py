"""A worker process's settings (the engine's own are in platform/config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.platform.errors import ConfigError
from splitserve.platform.settings.worker_args import ROLES, WorkerArgs
from splitserve.platform.wire.disaggregation import DISAGGREGATION_MODES

TRANSPORTS = ("ucx", "tcp", "inproc", "auto")  # auto: tcp, plus CUDA IPC on a GPU (transfer/cuda_ipc.py)
MODES = tuple(DISAGGREGATION_MODES)


@dataclass(frozen=True)
class WorkerConfig:
    """`min_prefill_tokens`: in conditional mode a decode worker asks a prefill worker only when
    at least this many prompt tokens are missing from its own prefix cache; below that, local
    prefill is cheaper than the round trip. `transfer_deadline_s` bounds the whole remote
    prefill (compute + transfer); after it the decode worker prefills locally."""

    role: str = "both"
    host: str = "127.0.0.1"
    advertise_host: str = ""  # what other workers dial (pod IP); "" = the bound address
    grpc_port: int = 50051
    metrics_port: int = 9090
    kv_transport: str = "ucx"
    kv_port: int = 13337
    disaggregation: str = "conditional"
    min_prefill_tokens: int = 256
    transfer_deadline_s: float = 30.0
    drain_grace_s: float = 120.0
    load_interval_s: float = 0.5
    kv_layer_streaming: bool = True  # send each layer as it is computed (False: after the whole prompt)
    kv_secret_file: str = ""  # the service's KV-transfer secret (transfer/auth.py); "" = no auth
    tls_cert: str = ""  # mTLS on the gRPC API (platform/wire/grpc_tls.py): all three or none
    tls_key: str = ""
    tls_ca: str = ""
    tls_check_peer_roles: bool = False  # each RPC only for the caller roles its certificate names (grpc_guard.py)
    kv_pull: bool = True  # accept a router's kv_pull (workers/kv_pull.py); False: always recompute
    max_pull_blocks: int = 1024  # the largest pull, in blocks; more of a prefix is computed here

    @classmethod
    def from_args(cls, args: WorkerArgs) -> WorkerConfig:
        """The worker's part of its settings (platform/settings/worker_args.py)."""
        return cls(**args.worker_fields())

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("role", self.role, ROLES),
            ("kv_transport", self.kv_transport, TRANSPORTS),
            ("disaggregation", self.disaggregation, MODES),
        ):
            if value not in allowed:
                raise ConfigError(f"{name}={value!r} is not supported; allowed: {', '.join(allowed)}")
        for name in ("grpc_port", "metrics_port", "kv_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name}={getattr(self, name)} is not a port; allowed: 0-65535 (0 picks a free one)")
        if self.tls_check_peer_roles and not self.tls_cert:
            raise ConfigError(
                "--tls-check-peer-roles needs mutual TLS (--tls-cert, --tls-key, --tls-ca): the roles "
                "come from the callers' certificates"
            )
        if self.min_prefill_tokens < 0:
            raise ConfigError(f"min_prefill_tokens must be >= 0, got {self.min_prefill_tokens}")
        if self.max_pull_blocks < 1:
            raise ConfigError(
                f"max_pull_blocks must be >= 1 (--max-pull-blocks; --no-kv-pull turns pulls off), "
                f"got {self.max_pull_blocks}"
            )
        if self.transfer_deadline_s <= 0 or self.drain_grace_s < 0 or self.load_interval_s <= 0:
            raise ConfigError("transfer_deadline_s and load_interval_s must be > 0 and drain_grace_s >= 0")
