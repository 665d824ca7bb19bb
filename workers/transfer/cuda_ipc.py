"""Same-node KV over CUDA IPC: the prefill worker writes straight into the decode worker's blocks.

What the path needs: the two worker processes on one node, able to map each other's device
memory — the same GPU, or two GPUs with peer access (NVLink, or PCIe P2P) — and sharing an IPC
namespace (in Kubernetes both containers in one pod, or `hostIPC`); and an authenticated KV
channel (`--kv-secret-file`): a mapped cache can be written by whoever holds its handles, so
they are only ever handed over a connection that passed the handshake (auth.py).

How it goes, on top of the tcp/ucx channel (stream.py), once per connection and then per
transfer:

    sender -> receiver   {"op": "ipc_hello", "version", "node"}                after the handshake
    receiver -> sender   {"type": "ipc_offer", "version", "node", "device_uuid", "dtype",
                          "cache_shape", "tensors": [K0, V0, K1, ...], "tag"}  (or "ipc_declined", "reason")
    sender -> receiver   {"op": "open", ..., "ipc": true}                      a transfer over IPC
    receiver -> sender   {"type": "ipc_ready", "transfer_id", "block_ids"}     its destination blocks
    sender -> receiver   {"op": "ipc_layers", "transfer_id", "layers", "first_block", "num_blocks"}
                                                                               written, no payload

The offer's tag is HMAC(session key, the offer's canonical JSON): the sender maps handles only
from the receiver it authenticated. Each tensor entry holds what `cudaIpcGetMemHandle` gives
for one cache tensor (base64 handle, sizes, offsets); the sender opens them with torch's own
IPC machinery (no pickle: every field is checked before use). A piece is announced with
"ipc_layers" only after the sender's copy completed on its stream (its thread waited on an
event), so the decode worker's later kernels read finished bytes.

Any failure falls back to bytes on the same connection, never failing the request: a declined
or unverifiable offer (another node, a GPU not visible here, no peer access, a bad tag, handles
that do not open, an offer too large for one header: about 800 bytes a layer, so past ~80
layers) makes the connection a plain one; a transfer whose receiver has no block ids
for it ("ipc_ready" with none) sends bytes; a copy that raises fails that transfer, and the
decode worker falls back as for any failed transfer (its next prefill worker, or local prefill).
`choose_path` decides what `--kv-transport auto` means on a worker and says why.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import pathlib
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from splitserve.workers.transfer.stream import MAX_HEADER_BYTES

log = logging.getLogger(__name__)

VERSION = 1
AUTO = "auto"


class IpcUnavailable(Exception):
    """CUDA IPC cannot be used on this connection; the message says why (the transfer uses bytes)."""


@dataclass(frozen=True)
class PathChoice:
    """What a worker's `--kv-transport` resolves to: the byte transport (`wire`), whether it
    offers or tries CUDA IPC on top of it, and why."""

    wire: str
    ipc: bool
    reason: str


def choose_path(requested: str, has_cuda: bool, has_auth: bool) -> PathChoice:
    """`auto`: tcp for the bytes (UCX's CUDA wheels are not assumed), plus CUDA IPC when the KV
    cache is on a CUDA device and the KV channel is authenticated. An explicit transport is
    taken as asked, without IPC."""
    if requested != AUTO:
        return PathChoice(requested, False, f"--kv-transport {requested}")
    if not has_cuda:
        return PathChoice("tcp", False, "auto: the KV cache is not on a CUDA device, so KV goes over tcp")
    if not has_auth:
        return PathChoice(
            "tcp",
            False,
            "auto: no --kv-secret-file, and CUDA IPC hands out device memory only over "
            "an authenticated KV channel, so KV goes over tcp",
        )
    return PathChoice(
        "tcp", True, "auto: CUDA IPC to decode workers on this node that can reach this GPU, tcp otherwise"
    )


def node_identity() -> str:
    """This machine: host name and boot id (two containers of one node agree; two nodes do not)."""
    boot = pathlib.Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else '-'}"


# -- where the handles come from and go to -------------------------------------------------
class IpcBackend(ABC):
    """Shares cache tensors between processes (CUDA) or, in tests, within one (`local`)."""

    @abstractmethod
    def device_uuid(self, device: torch.device) -> str:
        """An identifier of the device holding the cache, the same in every process."""

    @abstractmethod
    def share(self, tensor: torch.Tensor) -> dict:
        """A JSON-able entry another process turns back into `tensor` (its memory, not a copy)."""

    @abstractmethod
    def reach(self, device_uuid: str) -> torch.device:
        """The local device through which the peer's device is written; IpcUnavailable if none."""

    @abstractmethod
    def open(self, entry: dict, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The peer's tensor, mapped here (raises IpcUnavailable, or anything the driver raises)."""


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(value, what: str) -> bytes:
    if not isinstance(value, str):
        raise IpcUnavailable(f"offer field {what} must be base64 text, got {type(value).__name__}")
    return base64.b64decode(value.encode(), validate=True)


class CudaIpcBackend(IpcBackend):
    """cudaIpc handles through torch's storage sharing (what torch.multiprocessing uses)."""

    def device_uuid(self, device: torch.device) -> str:
        return str(torch.cuda.get_device_properties(device).uuid)

    def share(self, tensor: torch.Tensor) -> dict:
        assert tensor.is_cuda and tensor.is_contiguous()
        (_, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
            tensor.untyped_storage()._share_cuda_()
        )
        return {
            "handle": _b64(handle),
            "storage_bytes": int(size),
            "storage_offset_bytes": int(offset),
            "ref_counter_handle": _b64(ref_handle),
            "ref_counter_offset": int(ref_offset),
            "event_handle": _b64(event_handle),
            "event_sync_required": bool(event_sync),
            "tensor_offset": int(tensor.storage_offset()),
        }

    def reach(self, device_uuid: str) -> torch.device:
        here = torch.device("cuda", torch.cuda.current_device())
        for i in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(i).uuid) != device_uuid:
                continue
            if i == here.index or torch.cuda.can_device_access_peer(here.index, i):
                return torch.device("cuda", i)
            raise IpcUnavailable(
                f"GPU {device_uuid} is visible here but has no peer access to GPU {here.index} "
                f"(CUDA IPC needs the same GPU or NVLink/PCIe P2P)"
            )
        raise IpcUnavailable(f"the decode worker's GPU {device_uuid} is not visible to this process")

    def open(self, entry: dict, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        ints = ("storage_bytes", "storage_offset_bytes", "ref_counter_offset", "tensor_offset")
        if not all(isinstance(entry.get(k), int) and entry[k] >= 0 for k in ints):
            raise IpcUnavailable(f"offer entry needs non-negative integers {ints}")
        event = entry.get("event_handle")
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index,
            _unb64(entry.get("handle"), "handle"),
            entry["storage_bytes"],
            entry["storage_offset_bytes"],
            _unb64(entry.get("ref_counter_handle"), "ref_counter_handle"),
            entry["ref_counter_offset"],
            None if event is None else _unb64(event, "event_handle"),
            bool(entry.get("event_sync_required")),
        )
        numel = torch.Size(shape).numel()
        elem = torch.empty((), dtype=dtype).element_size()
        if (entry["tensor_offset"] + numel) * elem > storage.nbytes():
            raise IpcUnavailable(f"a mapped cache tensor of {storage.nbytes()} bytes cannot hold shape {shape}")
        return torch.empty((0,), dtype=dtype, device=device).set_(storage, entry["tensor_offset"], shape)


# -- the receiver's side -------------------------------------------------------------------------
def offer(kv_caches, backend: IpcBackend, *, hello: dict, session_key: bytes | None) -> dict:
    """The reply to a sender's "ipc_hello": the cache's handles, tagged with the session key, or
    a decline with the reason."""
    try:
        if session_key is None:
            raise IpcUnavailable("this KV channel is not authenticated (no --kv-secret-file)")
        if hello.get("version") != VERSION:
            raise IpcUnavailable(f"CUDA IPC version {hello.get('version')!r} is not {VERSION}")
        if hello.get("node") != node_identity():
            raise IpcUnavailable("the prefill worker runs on another node")
        k0 = kv_caches[0][0]
        body = {
            "type": "ipc_offer",
            "version": VERSION,
            "node": node_identity(),
            "device_uuid": backend.device_uuid(k0.device),
            "dtype": str(k0.dtype).removeprefix("torch."),
            "cache_shape": list(k0.shape),
            "tensors": [backend.share(t) for kv in kv_caches for t in kv],
        }
        reply = {**body, "tag": offer_tag(session_key, body)}
        size = len(json.dumps(reply, separators=(",", ":")))
        if size > MAX_HEADER_BYTES - 4:  # the offer is one header: too many layers' handles for it
            raise IpcUnavailable(
                f"the offer of {len(body['tensors'])} cache tensors' handles is {size} bytes, more than "
                f"one KV header holds ({MAX_HEADER_BYTES - 4})"
            )
    except IpcUnavailable as exc:
        return {"type": "ipc_declined", "reason": str(exc)}
    return reply


def offer_tag(session_key: bytes, body: dict) -> str:
    return hmac.new(
        session_key, json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256
    ).hexdigest()


# -- the sender's side ---------------------------------------------------------------------------
def hello() -> dict:
    return {"op": "ipc_hello", "version": VERSION, "node": node_identity()}


def open_offer(reply: dict, session_key: bytes | None, backend: IpcBackend, layout) -> list[tuple[torch.Tensor, ...]]:
    """The decode worker's cache mapped here, per layer (K, V); IpcUnavailable with the reason
    when the reply is a decline or does not check out against the session and `layout`."""
    if reply.get("type") == "ipc_declined":
        raise IpcUnavailable(f"the decode worker declined: {reply.get('reason')}")
    if reply.get("type") != "ipc_offer" or session_key is None:
        raise IpcUnavailable(f"no CUDA IPC offer on an authenticated channel (got {reply.get('type')!r})")
    body = {k: v for k, v in reply.items() if k != "tag"}
    if not isinstance(reply.get("tag"), str) or not hmac.compare_digest(reply["tag"], offer_tag(session_key, body)):
        raise IpcUnavailable("the CUDA IPC offer's tag does not match this connection's session key")
    shape = reply.get("cache_shape")
    tensors = reply.get("tensors")
    if (
        reply.get("dtype") != layout.dtype
        or not isinstance(shape, list)
        or len(shape) != 4
        or shape[1:] != [layout.block_size, layout.num_kv_heads, layout.head_dim]
        or not isinstance(tensors, list)
        or len(tensors) != 2 * layout.num_layers
    ):
        raise IpcUnavailable(
            f"the offered cache ({reply.get('dtype')}, {shape}, {len(tensors or [])} tensors) does "
            f"not match the layout ({layout.dtype}, {layout.num_layers} layers)"
        )
    if reply.get("node") != node_identity():
        raise IpcUnavailable("the decode worker runs on another node")
    device = backend.reach(str(reply.get("device_uuid")))
    try:
        mapped = [backend.open(e, layout.torch_dtype, tuple(shape), device) for e in tensors]
    except IpcUnavailable:
        raise
    except Exception as exc:  # the driver refused the handle (another IPC namespace, ...)
        raise IpcUnavailable(f"the decode worker's cache handles do not open here: {exc}") from exc
    return [(mapped[2 * i], mapped[2 * i + 1]) for i in range(layout.num_layers)]


class BlockWriter:
    """Copies layer pieces into the mapped cache on a side stream (CUDA) and waits for them on
    the calling thread: the sender's worker thread, never the engine's or the event loop's."""

    def __init__(self, caches: list[tuple[torch.Tensor, ...]]):
        self.caches = caches
        device = caches[0][0].device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def write(self, layer: int, block_ids: list[int], payload: torch.Tensor) -> None:
        """Blocks `block_ids` of `layer` := payload ([2, n, ...], on the device or the host)."""
        k_cache, v_cache = self.caches[layer]
        with torch.inference_mode():
            if self.stream is None:
                ids = torch.tensor(block_ids, dtype=torch.long, device=k_cache.device)
                k_cache.index_copy_(0, ids, payload[0].to(k_cache.device))
                v_cache.index_copy_(0, ids, payload[1].to(v_cache.device))
                return
            self.stream.wait_stream(torch.cuda.current_stream(payload.device))
            with torch.cuda.stream(self.stream):
                ids = torch.tensor(block_ids, dtype=torch.long).to(k_cache.device, non_blocking=True)
                k_cache.index_copy_(0, ids, payload[0].to(k_cache.device, non_blocking=True))
                v_cache.index_copy_(0, ids, payload[1].to(v_cache.device, non_blocking=True))
                event = torch.cuda.Event()
                event.record(self.stream)
            event.synchronize()


class LocalIpcBackend(IpcBackend):
    """The reference implementation the tests use: "handles" are keys into this process' own
    registry, so both workers must live in one process (the inproc transport); everything else —
    the offer, its tag, the checks, the writes, the fallbacks — is the real code path."""

    def __init__(self, device_uuid: str = "local-device", reachable: bool = True, handle_bytes: int = 0):
        self._uuid, self._reachable = device_uuid, reachable
        self._padding = "h" * handle_bytes  # the size of a real handle entry (CUDA's: ~400 bytes a tensor)
        self._shared: dict[str, torch.Tensor] = {}
        self.fail_open = False  # a fault to inject: handles that do not open

    def device_uuid(self, device: torch.device) -> str:
        return self._uuid

    def share(self, tensor: torch.Tensor) -> dict:
        key = f"t{len(self._shared)}"
        self._shared[key] = tensor
        return {"handle": key, **({"padding": self._padding} if self._padding else {})}

    def reach(self, device_uuid: str) -> torch.device:
        if not self._reachable or device_uuid != self._uuid:
            raise IpcUnavailable(f"the decode worker's GPU {device_uuid} is not visible to this process")
        return torch.device("cpu")

    def open(self, entry: dict, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        if self.fail_open:
            raise RuntimeError("cudaIpcOpenMemHandle failed (injected)")
        tensor = self._shared[entry["handle"]]
        assert tensor.dtype == dtype and tuple(tensor.shape) == shape
        return tensor
