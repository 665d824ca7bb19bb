"""Where a decode worker's sidecar listens: the endpoint the gateway forwards to.

The EPP watches the workers over gRPC (their KV events and load), but the gateway talks HTTP to
the sidecar in front of each decode worker. In Kubernetes both are in one pod: the sidecar is the
worker's pod IP at the InferencePool's target port (`sidecar_port`). On one machine they differ
by port only, so explicit `pairs` (worker gRPC address -> sidecar host:port) win over the rule.
A decode worker with neither has no endpoint and is never picked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.platform.errors import ConfigError


def check_address(address: str, what: str) -> str:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} {address!r} is invalid; allowed: host:port with a port in 1..65535")
    return address


@dataclass(frozen=True)
class EndpointMap:
    pairs: dict[str, str] = field(default_factory=dict)
    sidecar_port: int | None = None

    def __post_init__(self) -> None:
        for worker, endpoint in self.pairs.items():
            check_address(worker, "worker address")
            check_address(endpoint, "sidecar endpoint")
        if self.sidecar_port is not None and not 0 < self.sidecar_port < 65536:
            raise ConfigError(f"sidecar port {self.sidecar_port} is invalid; allowed: 1..65535")

    @classmethod
    def parse(cls, items: list[str], sidecar_port: int | None = None) -> EndpointMap:
        """From `WORKER=ENDPOINT` strings (the --endpoint flag)."""
        pairs = {}
        for item in items:
            worker, sep, endpoint = item.partition("=")
            if not sep:
                raise ConfigError(f"--endpoint {item!r} is invalid; allowed: WORKER_HOST:PORT=SIDECAR_HOST:PORT")
            pairs[worker.strip()] = endpoint.strip()
        return cls(pairs, sidecar_port)

    def endpoint(self, worker: str) -> str | None:
        if worker in self.pairs:
            return self.pairs[worker]
        if self.sidecar_port is None:
            return None
        return f"{worker.rpartition(':')[0]}:{self.sidecar_port}"
