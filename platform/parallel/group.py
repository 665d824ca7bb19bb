"""A rank's process group and the collectives the sharded layers call.

`TPGroup` is what a layer holds: its rank, the group size and two collectives, `all_reduce`
(the row-parallel linears, the vocabulary-parallel embedding, the experts) and `all_gather`
(the LM head's logits); `gather` and `scatter` (to and from rank 0) move a KV transfer's heads
(engine/kv_parallel.py). With size 1 both return their input untouched, so an unsharded model
pays one attribute check per call. Each call is timed (`stats`): on a CPU the time is the
collective itself plus the wait for the slowest rank; on CUDA it is the launch only.

Layers learn their group when they are built: `building(group)` makes it `current()` for the
model's constructor (vLLM keeps one global group per process instead; a context keeps two
engines of different sizes possible in one process, as the tests build them).

The device group is NCCL on CUDA (the device set before init) and gloo on a CPU; a second gloo
group carries metadata. Every collective has `COLLECTIVE_TIMEOUT_S`: a rank that stops answering
makes the others raise instead of waiting forever (the executor's watchdog is the other half).
"""

from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# A collective that waits longer than this raises on the ranks still in it. A legitimate wait is
# one rank's share of one layer, far below it; a stopped or hung rank trips it.
COLLECTIVE_TIMEOUT_S = 20.0


@dataclass
class CollectiveStats:
    """Collectives run by this rank and the seconds spent in them (reset by the reader)."""

    num_calls: int = 0
    seconds: float = 0.0

    def take(self) -> tuple[int, float]:
        out = (self.num_calls, self.seconds)
        self.num_calls, self.seconds = 0, 0.0
        return out


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    device_group: object = None  # the torch ProcessGroup of the collectives (None: size 1)
    cpu_group: object = None  # gloo, for metadata
    stats: CollectiveStats = field(default_factory=CollectiveStats)

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.device_group)
        self._count(t0)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dimension, in rank order (same shapes)."""
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.device_group)
        self._count(t0)
        return torch.cat(parts, dim=-1)

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (same shapes), in rank order, on rank 0; None on the other ranks."""
        if self.size == 1:
            return [x]
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.device_group)
        self._count(t0)
        return parts

    def scatter(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> torch.Tensor:
        """Rank r receives rank 0's `parts[r]` into `out` (same shape on every rank); `parts` is
        read on rank 0 only. Returns `out`."""
        if self.size == 1:
            return out.copy_(parts[0])
        t0 = time.perf_counter()
        dist.scatter(out, [p.contiguous() for p in parts] if self.rank == 0 else None, src=0, group=self.device_group)
        self._count(t0)
        return out

    def _count(self, t0: float) -> None:
        self.stats.num_calls += 1
        self.stats.seconds += time.perf_counter() - t0


SINGLE = TPGroup()
_current: list[TPGroup] = [SINGLE]


def current() -> TPGroup:
    """The group of the model being built (SINGLE outside `building`)."""
    return _current[-1]


@contextlib.contextmanager
def building(group: TPGroup):
    """Make `group` current while a model's layers are constructed."""
    _current.append(group)
    try:
        yield group
    finally:
        _current.pop()


def init_group(rank: int, size: int, master_addr: str, master_port: int, device: torch.device) -> TPGroup:
    """Join the group of `size` ranks meeting at master_addr:master_port (blocks until all came,
    at most COLLECTIVE_TIMEOUT_S * 3). One group per process: ConfigError if one exists."""
    from splitserve.platform.errors import ConfigError

    if dist.is_initialized():
        raise ConfigError(
            "this process already runs a tensor-parallel group; close that engine first (one group per process)"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S * 3),
    )
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    device_group = dist.new_group(list(range(size)), backend=backend, timeout=timeout)
    cpu_group = device_group
    if backend != "gloo":
        cpu_group = dist.new_group(list(range(size)), backend="gloo", timeout=timeout)
    return TPGroup(rank, size, device_group, cpu_group)


def close_group() -> None:
    """Leave the process's group (idempotent); a failed group is torn down as far as it goes."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
