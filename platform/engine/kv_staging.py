"""Moving KV between the device and the host without stopping the device: copy streams, ready
markers and a pool of reused host buffers.

A prefill worker's export and a decode worker's import each run their copies through a
`CopyStream`:

* `submit(fn)` runs `fn` (the copies) ordered after the work the compute stream has queued so
  far, and returns a `Ready` marker. On CUDA (`CudaCopyStream`) `fn` runs on a side stream and
  the marker is an event recorded after it: the caller's thread does not wait. On a CPU
  (`SyncCopyStream`) `fn` runs right away and the marker is already set: the CPU path is the
  plain synchronous copy it always was.
* `Ready.wait()` blocks until the copies completed. Only the thread that consumes the copy
  calls it (the sender's thread before it puts a host buffer on the wire), never the engine
  thread.
* `order_compute_after()` makes the compute stream wait for everything submitted so far (on
  CUDA `wait_stream`: queued on the device, the host does not wait). The engine calls it once
  per step, so a decode step that reads imported blocks, or a step that reuses an exported
  block, is ordered after those copies by an event and not by a device-wide synchronize.

`HostBufferPool` keeps host buffers (pinned on CUDA, so the copies are asynchronous DMA) for
reuse, one free list per size class (sizes rounded up to within 1/8 of a power of two, at least
1 MiB, so prompts of other lengths reuse the same buffers and at most ~12 % is wasted). A buffer
is lent by `acquire`, and `release(buf, ready)` returns it; it is lent again only once its
marker says the device finished with it. `max_idle_bytes` bounds what the pool keeps while
idle: a buffer released beyond it is dropped (freed when its last user lets go).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch


class Ready(ABC):
    """Marks the completion of copies submitted to a CopyStream."""

    @abstractmethod
    def is_ready(self) -> bool:
        """Whether the copies completed (never blocks)."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the copies completed (the consumer's thread only, never the engine's)."""


class DoneReady(Ready):
    """Already complete: what the synchronous CPU path returns."""

    def is_ready(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = DoneReady()


class CopyStream(ABC):
    """Where KV copies run; see the module docstring for the ordering it guarantees."""

    @abstractmethod
    def submit(self, fn: Callable[[], None], keep: tuple[torch.Tensor, ...] = ()) -> Ready:
        """Run `fn`'s copies ordered after the compute stream's queued work; return their marker.
        `keep`: device tensors the compute stream allocated that `fn` reads (kept alive for it)."""

    @abstractmethod
    def order_compute_after(self) -> None:
        """Make the compute stream's later work wait for every copy submitted so far (host never waits)."""


class SyncCopyStream(CopyStream):
    """The CPU implementation: copies run at once, in the caller's thread; nothing to order."""

    def submit(self, fn: Callable[[], None], keep: tuple[torch.Tensor, ...] = ()) -> Ready:
        fn()
        return DONE

    def order_compute_after(self) -> None:
        return None


class CudaReady(Ready):
    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def is_ready(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


class CudaCopyStream(CopyStream):
    """A side CUDA stream: `submit` waits (on the device) for the compute stream, runs `fn` there
    and records an event. Tensors `fn` allocates belong to the side stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._lock = threading.Lock()  # submit runs on the engine thread (export) or the loop (import)
        self._pending = False

    def submit(self, fn: Callable[[], None], keep: tuple[torch.Tensor, ...] = ()) -> Ready:
        compute = torch.cuda.current_stream(self.device)
        with self._lock:
            self.stream.wait_stream(compute)
            for t in keep:
                t.record_stream(self.stream)
            with torch.cuda.stream(self.stream):
                fn()
                event = torch.cuda.Event()
                event.record(self.stream)
            self._pending = True
        return CudaReady(event)

    def order_compute_after(self) -> None:
        with self._lock:
            if self._pending:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
                self._pending = False


def make_copy_stream(device: torch.device) -> CopyStream:
    """A side stream on CUDA, the synchronous path elsewhere."""
    return CudaCopyStream(device) if device.type == "cuda" else SyncCopyStream()


MIN_BUFFER_BYTES = 1 << 20


def size_class(nbytes: int) -> int:
    """The pool's size for a request of `nbytes`: at least 1 MiB, else rounded up to a multiple of
    an eighth of the largest power of two not above it."""
    if nbytes <= MIN_BUFFER_BYTES:
        return MIN_BUFFER_BYTES
    step = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


class HostBufferPool:
    """Reused uint8 host buffers by size class; thread-safe (the module docstring)."""

    def __init__(self, pin: bool, max_idle_bytes: int = 4 << 30):
        if max_idle_bytes < 0:
            raise ValueError(f"max_idle_bytes must be >= 0, got {max_idle_bytes}")
        self.pin = pin
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._idle: dict[int, list[tuple[torch.Tensor, Ready]]] = {}
        self._idle_bytes = 0
        self.num_allocated = 0  # buffers ever made (reuse keeps it flat)
        self.num_lent = 0  # buffers acquired and not released (0 when nothing leaks)

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least `nbytes` (its size class; use `buf[:nbytes]`) that the device no
        longer uses: an idle one, or a new one."""
        if nbytes <= 0:
            raise ValueError(f"a host buffer needs a positive size, got {nbytes}")
        size = size_class(nbytes)
        with self._lock:
            idle = self._idle.get(size, [])
            for i, (buf, ready) in enumerate(idle):
                if ready.is_ready():
                    del idle[i]
                    self._idle_bytes -= size
                    self.num_lent += 1
                    return buf
            self.num_allocated += 1
            self.num_lent += 1
        with torch.inference_mode(False):  # a normal tensor: export fills it in inference mode, import outside
            return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def release(self, buf: torch.Tensor, ready: Ready = DONE) -> None:
        """Give back a buffer `acquire` returned; it is lent again once `ready` (copies still
        reading or writing it) completed."""
        with self._lock:
            self.num_lent -= 1
            assert self.num_lent >= 0, "a host buffer was released twice"
            if self._idle_bytes + buf.numel() <= self.max_idle_bytes:
                self._idle.setdefault(buf.numel(), []).append((buf, ready))
                self._idle_bytes += buf.numel()

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes


class StagedPayload:
    """One exported layer piece on its way to the wire: `tensor` ([2, n, block_size, kv_heads,
    head_dim], host memory) is valid once `ready` is; `release()` (exactly once, after its bytes
    left or were dropped) hands its buffer back to the pool."""

    def __init__(self, tensor: torch.Tensor, ready: Ready = DONE, on_release: Callable[[], None] | None = None):
        self.tensor = tensor
        self.ready = ready
        self._on_release = on_release

    @property
    def num_blocks(self) -> int:
        return self.tensor.shape[1]

    def release(self) -> None:
        on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release()
