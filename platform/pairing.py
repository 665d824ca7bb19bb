"""Topology-aware pairing: which prefill worker to pair with a chosen decode worker.

The cost of a prefill worker P for a request whose decode worker D is already chosen is the
time until D holds the prompt's KV:

    cost(P) = wait(P) + compute + exposed transfer
            = P.queued_prefill_tokens / prefill_rate + prompt_tokens / prefill_rate
              + exposed_fraction * kv_bytes / bandwidth(P, D)

`bandwidth(P, D)` is `same_node_bytes_per_s` when P runs on D's node (KV moves device to device
over CUDA IPC) and `cross_node_bytes_per_s` otherwise (tcp, or UCX over RDMA). With per-layer
streaming most of the transfer hides behind compute; `exposed_fraction` is the part that does
not (the measured exposed transfer over the transfer's total). The compute term is the same for
every P and only makes the reason's figures whole.

So a same-node P wins unless another node's P is less busy by more than the transfer costs: a
queue of 2,000 tokens at 20,000 tokens/s (0.1 s) outweighs the exposed transfer of 1 GiB at
45 GB/s (24 ms in full), but not an idle-vs-idle tie. Pure: no router state, no I/O, torch-free,
so the router's placement calls it with the candidates' load reports and nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PairingModel:
    """Rates from measurements (defaults: an H100 node, NVLink/IPC within it, RDMA across)."""

    prefill_tokens_per_s: float = 20_000.0
    same_node_bytes_per_s: float = 400e9
    cross_node_bytes_per_s: float = 45e9
    exposed_fraction: float = 0.25

    def __post_init__(self):
        for name in ("prefill_tokens_per_s", "same_node_bytes_per_s", "cross_node_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PairingModel.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.exposed_fraction <= 1:
            raise ValueError(f"PairingModel.exposed_fraction must be in [0, 1], got {self.exposed_fraction!r}")


@dataclass(frozen=True)
class PrefillCandidate:
    address: str
    node: str  # the node it runs on ("" unknown: treated as another node)
    queued_prefill_tokens: int = 0


@dataclass(frozen=True)
class Pairing:
    address: str
    cost_s: float
    reason: str


def pairing_cost_s(
    candidate: PrefillCandidate,
    decode_node: str,
    prompt_tokens: int,
    kv_bytes: int,
    model: PairingModel = PairingModel(),
) -> float:
    """Seconds until the decode worker holds the KV if `candidate` prefills (the module docstring)."""
    same = bool(candidate.node) and candidate.node == decode_node
    bandwidth = model.same_node_bytes_per_s if same else model.cross_node_bytes_per_s
    return (
        candidate.queued_prefill_tokens + prompt_tokens
    ) / model.prefill_tokens_per_s + model.exposed_fraction * kv_bytes / bandwidth


def pick_prefill(
    candidates: Sequence[PrefillCandidate],
    decode_node: str,
    prompt_tokens: int,
    kv_bytes: int,
    model: PairingModel = PairingModel(),
) -> Pairing:
    """The cheapest candidate (ties: a same-node one, then the first), with the reason in words."""
    if not candidates:
        raise ValueError("pick_prefill needs at least one prefill candidate")
    if prompt_tokens < 0 or kv_bytes < 0:
        raise ValueError(f"prompt_tokens and kv_bytes must be >= 0, got {prompt_tokens} and {kv_bytes}")
    costs = [
        (pairing_cost_s(c, decode_node, prompt_tokens, kv_bytes, model), c.node != decode_node or not c.node, i)
        for i, c in enumerate(candidates)
    ]
    cost, _, i = min(costs)
    best = candidates[i]
    same = best.node == decode_node and bool(best.node)
    others = [c for c, (_, remote, _) in zip(candidates, costs, strict=True) if remote != (not same)]
    if same:
        reason = f"prefill on the decode worker's node {decode_node} (KV device to device): {cost * 1e3:.1f} ms"
    else:
        reason = f"prefill on node {best.node or 'unknown'}: {cost * 1e3:.1f} ms"
    if others:
        alt = min(pairing_cost_s(c, decode_node, prompt_tokens, kv_bytes, model) for c in others)
        reason += f", {(alt - cost) * 1e3:.1f} ms less than the best {'other-node' if same else 'same-node'} worker"
    return Pairing(best.address, cost, reason)
