"""The KV-transfer interface: what the decode worker (receiver) and prefill worker (sender) see.

A transfer moves one request's prompt KV, layer by layer, from a prefill worker to a decode
worker and is identified by a `transfer_id` the decode worker chooses. Its life on each side:

* Receiver (decode worker, push target): `expect()` registers it (WAITING) with the layout the
  decode worker's cache has, the number of blocks and a `write_layer` callback; the sender's
  first message moves it to RECEIVING (or FAILED on a layout mismatch); each landed piece of
  a layer (a run of its blocks, see below) is handed to `write_layer`; when every block of
  every layer landed and the sender said it is finished it is DONE and the sender gets its
  acknowledgement. `abort()` (client gone) makes it ABORTED; the deadline makes it TIMED_OUT; a
  lost sender makes it FAILED. `poll()` never blocks, `wait()` returns at a terminal state,
  `release()` forgets it.
* Sender (prefill worker): `open()` gets a `SendHandle` on a pooled connection;
  `send_layer()` queues each layer as soon as it is computed (so sending overlaps compute);
  a layer may go in pieces, each a run of consecutive blocks in order (`first_block`), so with
  chunked prefill the blocks a chunk completed leave while the next chunk computes;
  `finish()` returns once the receiver acknowledged that every layer was written, and is the
  one place where a failure of the transfer (mismatch, unknown id, abort, timeout, lost
  connection) surfaces, as `TransferError`.

A transfer is a polled state machine with an abort, never a blocking call (docs/design.md).
"""

from __future__ import annotations

import enum
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields

import torch

DTYPES = ("float32", "bfloat16", "float16")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class TransferError(Exception):
    """A transfer did not complete: rejected, aborted, timed out, or its connection was lost."""


class UnknownTransferError(TransferError):
    """The receiver holds no transfer with this id: it never expected it, or has released it."""


class LayoutMismatchError(TransferError):
    """The two sides' KV layouts differ. `mismatches` maps each field to (expected, got)."""

    def __init__(self, message: str, mismatches: dict[str, tuple] | None = None):
        super().__init__(message)
        self.mismatches = mismatches or {}


@dataclass(frozen=True)
class KVLayout:
    """How one layer's KV is shaped and typed; both sides must agree on every field."""

    model_id: str
    dtype: str  # one of DTYPES
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # the resolved --quantization of the weights that compute this KV (platform/quant): a
    # prefill in int4 and a decode in "none" would not give the colocated answer
    weights: str = "none"
    # the LoRA adapter that computes this KV, per request: the hex sha256 of its config and weights
    # ("" = the base model), so a prefill running other weights under the same adapter name is refused
    lora_digest: str = ""

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
        if not isinstance(self.lora_digest, str) or (self.lora_digest and not _HEX64.match(self.lora_digest)):
            raise ValueError(f"KVLayout.lora_digest must be '' or 64 hex digits, got {self.lora_digest!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def check_compatible(self, other: KVLayout) -> None:
        """Raise LayoutMismatchError naming every differing field as `field: expected X, got Y`
        (self is what this side expects, `other` what the peer has)."""
        diff = {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        }
        if diff:
            parts = "; ".join(f"{name}: expected {a!r}, got {b!r}" for name, (a, b) in diff.items())
            raise LayoutMismatchError(f"KV layout mismatch: {parts}", diff)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        """Build from `to_dict()` output; a missing or unknown key is a ValueError naming it."""
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing, unknown = required - d.keys(), d.keys() - names
        if missing or unknown:
            raise ValueError(f"bad KV layout {d!r}: missing {sorted(missing)}, unknown {sorted(unknown)}")
        return cls(**d)

    def layer_payload_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """One layer's payload: K and V stacked, (2, num_blocks, block_size, num_kv_heads, head_dim)."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def layer_payload_nbytes(self, num_blocks: int) -> int:
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * num_blocks * self.block_size * self.num_kv_heads * self.head_dim * elem


class TransferState(enum.Enum):
    WAITING = "waiting"  # expected, nothing arrived yet
    RECEIVING = "receiving"  # the sender opened it with a matching layout
    DONE = "done"  # every layer written and acknowledged
    FAILED = "failed"  # layout mismatch, protocol error, write_layer raised, sender lost
    ABORTED = "aborted"  # abort() on the receiver
    TIMED_OUT = "timed_out"  # deadline passed before DONE

    @property
    def is_terminal(self) -> bool:
        return self not in (TransferState.WAITING, TransferState.RECEIVING)


@dataclass(frozen=True)
class TransferStatus:
    """A snapshot; num_bytes counts payload bytes of the layers written (headers excluded)."""

    state: TransferState
    num_layers_done: int
    num_bytes: int
    error: str | None = None


# write_layer(layer, payload, first_block): `payload` holds blocks [first_block, first_block + n)
# of the transfer (n = payload.shape[1]).
WriteLayer = Callable[[int, torch.Tensor, int], None]


class KVReceiver(ABC):
    """The decode worker's end. Lives in (and is only called from) one asyncio loop.

    It owns the per-transfer state; the decode worker sees it only through these methods.
    """

    address: str  # "ucx://host:port", "tcp://host:port" or "inproc://name"; valid after start()

    @abstractmethod
    async def start(self) -> None:
        """Start listening; sets `address` (a port of 0 picks a free one)."""

    @abstractmethod
    async def close(self) -> None:
        """Stop listening, drop connections; transfers not yet terminal become FAILED."""

    @abstractmethod
    def expect(
        self,
        transfer_id: str,
        layout: KVLayout,
        num_blocks: int,
        write_layer: WriteLayer,
        deadline_s: float,
        block_ids=None,
        layer_skip: tuple[int, ...] = (),
    ) -> None:
        """Register an incoming transfer (WAITING) before asking the sender to send it.

        `write_layer(layer, payload, first_block)` is called in the loop as each piece of a layer
        lands, payload of `layout.layer_payload_shape(n)` (blocks first_block..first_block+n-1 of
        the transfer) and `layout.dtype`; the payload is only valid
        during the call (the receiver reuses its buffer): copy out of it. If it raises, the
        transfer FAILS. `deadline_s` is seconds from now; at the deadline a transfer not yet
        DONE becomes TIMED_OUT. A transfer_id already registered is a ValueError. `block_ids`: the
        `num_blocks` cache blocks the KV goes to, which a CUDA IPC sender writes directly
        (cuda_ipc.py); without them the transfer always goes as bytes through `write_layer`.
        `layer_skip`: per layer, the leading blocks the sender does not send (a sliding-window
        layer's blocks before its window, engine KVReady.layer_skip); () for none.
        """

    @abstractmethod
    def poll(self, transfer_id: str) -> TransferStatus:
        """Current status, never blocks; KeyError for an id not registered (or released)."""

    @abstractmethod
    def abort(self, transfer_id: str) -> None:
        """Make a non-terminal transfer ABORTED: later data for it is discarded and the sender's
        finish() raises TransferError. No-op on a terminal or unknown transfer."""

    @abstractmethod
    async def wait(self, transfer_id: str) -> TransferStatus:
        """Return the status once terminal (DONE, FAILED, ABORTED or TIMED_OUT); the deadline
        given to expect() bounds it. KeyError for an unknown id."""

    @abstractmethod
    def release(self, transfer_id: str) -> None:
        """Forget a transfer (aborting it first if not terminal): afterwards the receiver holds
        no state for it and a sender using the id is told "unknown transfer id". Idempotent."""

    @abstractmethod
    def quarantine(self, transfer_id: str):
        """After a CUDA IPC transfer ended other than DONE: an asyncio.Event set once its
        destination blocks may go to another request (its sender can no longer write them: it
        sent its "end", or its connection closed a grace period ago), or None when nothing
        holds them back. Valid after release() too; the caller holds the blocks meanwhile."""

    @property
    @abstractmethod
    def num_transfers(self) -> int:
        """How many transfers are registered and not released (0 when nothing leaks)."""


class SendHandle(ABC):
    """One outgoing transfer, owned by the task that opened it.

    `bytes_sent` counts payload bytes that went onto the wire (headers excluded); `error` is
    the failure if one is already known (the receiver may reject or abort early), so a prefill
    worker can stop sending; `finish()` raises it.
    """

    bytes_sent: int
    error: TransferError | None
    path: str
    """How the KV goes: the transport's scheme, or "cuda_ipc" once the receiver took a CUDA IPC
    transfer (the kv.send span and splitserve_kv_transfers_total{path} report it)."""

    @property
    @abstractmethod
    def wants_device_payloads(self) -> bool:
        """Whether send_layer should get device tensors (a CUDA IPC connection copies them
        itself); False: host tensors (the engine stages each layer to host memory first)."""

    @abstractmethod
    async def send_layer(self, layer: int, payload: torch.Tensor, first_block: int = 0, on_sent=None) -> None:
        """Queue one layer, or the next piece of it: contiguous, `layout.dtype`,
        `layout.layer_payload_shape(n)` for blocks [first_block, first_block + n) of the transfer,
        where first_block is where the layer's previous piece ended (0 for its first); else
        ValueError. Returns without waiting for the wire; the handle keeps a reference to
        `payload` until it is sent, so the caller must not modify it afterwards. Once the
        transfer failed, layers are dropped silently (finish() reports the failure).
        `on_sent()`, if given, is called exactly once when the transport no longer reads `payload`
        (the receiver's final reply came, or the connection was closed): then its buffer may be
        reused (kv_staging.HostBufferPool)."""

    @abstractmethod
    async def finish(self) -> None:
        """Wait until every queued layer is sent and the receiver acknowledged writing all of
        them. Raises TransferError (LayoutMismatchError for a mismatch) on any failure. The
        connection goes back to the sender's pool on success."""

    @abstractmethod
    async def abort(self) -> None:
        """Drop layers not yet sent and tell the receiver (its transfer becomes FAILED)."""


class KVSender(ABC):
    """The prefill worker's end. Lives in one asyncio loop; keeps a pool of idle connections
    per receiver address, so consecutive transfers to one decode worker reuse a connection."""

    @abstractmethod
    async def open(self, address: str, transfer_id: str, layout: KVLayout, num_blocks: int) -> SendHandle:
        """Start a transfer to `address`. Raises TransferError if the receiver is unreachable,
        ValueError for an address of another transport."""

    @abstractmethod
    async def close(self) -> None:
        """Close pooled connections (call when no transfer is in flight)."""
