"""Pull instead of recompute: a worker fetches a prompt prefix's KV from the worker that holds it.

The router sends a request to worker W with `kv_pull = (holder H, n blocks)` when its prefix
index says H holds the prompt's first n blocks and W fewer (router/placement/pull_cost.py decides when a
pull beats recomputing). The pull is the P/D transfer with no compute on the sending side:

    W: the engine allocates blocks for the whole prompt and reuses its own hits (KVReady, as for
       a remote prefill); W registers the transfer with its KV receiver for blocks
       [start, end), end = min(n, blocks below the last prompt token, start + max_pull_blocks),
       and calls H.Prefill(cached_only, skip_blocks=start, num_blocks=end-start, the blocks'
       hashes, W's layout and KV address)
    H: `serve_cached` checks the layout (as for a prefill), hashes the prompt itself and
       compares with W's hashes, then, in one call on its engine thread, copies those blocks'
       KV out of its cache (or its second tier); a block it no longer holds is
       FAILED_PRECONDITION. The copies go over the authenticated KV transport, a SHA-256 per
       layer comes back in the answer.
    W: when every layer landed and every digest matches, the engine continues the request with
       `end * block_size` prompt tokens computed and prefills the rest locally.

Whatever goes wrong (H unreachable or killed mid-pull, blocks evicted in between, another
layout, other hashes, a payload altered on the way, the deadline) W aborts the transfer (late
bytes are discarded), counts a failed pull and prefills from its own hits: a request never fails
because of a pull. Nothing is held on H (the copy is made between two engine steps, so an eviction
cannot race it) and W's blocks belong to the request, freed with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
import uuid

import grpc
import torch

from splitserve.platform.engine.async_engine import AsyncEngine
from splitserve.platform.engine.kv_handoff import KVReady
from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire.grpc_channels import ChannelPool
from splitserve.platform.wire.grpc_tls import TlsFiles
from splitserve.workers import faults, wire
from splitserve.workers.prefill import _request_layout
from splitserve.workers.transfer.base import KVLayout, KVReceiver, KVSender, TransferError, TransferState

log = logging.getLogger(__name__)


class BlocksNotHeldError(Exception):
    """The holder no longer holds (or never held) the blocks asked for: FAILED_PRECONDITION."""


def layer_digest(payload: torch.Tensor) -> bytes:
    return hashlib.sha256(payload.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()).digest()


# -- the holder ------------------------------------------------------------------------------
async def serve_cached(
    engine: AsyncEngine, sender: KVSender, layout: KVLayout, request: pb.PrefillRequest, metrics=None
) -> pb.PrefillResponse:
    """Send the KV of cached blocks, computing nothing. Raises InvalidRequestError,
    LayoutMismatchError, BlocksNotHeldError, TransferError."""
    token_ids = wire.prompt_token_ids(
        request.request_id, request.prompt_token_ids, engine.model_config.vocab_size, engine.max_model_len
    )
    if not request.transfer_id or not request.kv_address:
        raise InvalidRequestError("transfer_id and kv_address are required for a pull")
    layout.check_compatible(_request_layout(request))  # a pull is for the base model: no adapter digest
    bs = layout.block_size
    start, num_blocks = request.skip_blocks, request.num_blocks
    if start < 0 or num_blocks < 1 or start + num_blocks > len(token_ids) // bs:
        raise InvalidRequestError(
            f"skip_blocks={start}, num_blocks={num_blocks} is invalid for a pull of a "
            f"{len(token_ids)}-token prompt; allowed: skip_blocks >= 0, num_blocks >= 1, "
            f"their sum at most {len(token_ids) // bs} (its full blocks)"
        )
    if len(request.block_hashes) != num_blocks:
        raise InvalidRequestError(
            f"a pull of {num_blocks} blocks needs {num_blocks} block_hashes, got {len(request.block_hashes)}"
        )
    t0 = time.monotonic()
    payloads = await engine.call(
        lambda e: _copy_blocks(e, token_ids[: (start + num_blocks) * bs], start, list(request.block_hashes))
    )
    handle = await sender.open(request.kv_address, request.transfer_id, layout, num_blocks)
    digests = []
    try:
        for layer, payload in enumerate(payloads):
            digests.append(layer_digest(payload))
            await handle.send_layer(layer, faults.tamper_pull(payload), 0)
            faults.after_layer_sent(layer)
        await handle.finish()
    except BaseException:
        await handle.abort()
        raise
    if metrics is not None:
        metrics.kv_pull_blocks.labels(direction="out").inc(num_blocks)
        metrics.kv_transfer_bytes.labels(direction="out").observe(handle.bytes_sent)
    return pb.PrefillResponse(kv_bytes=handle.bytes_sent, transfer_wait_s=time.monotonic() - t0, layer_digests=digests)


def _copy_blocks(engine, token_ids: list[int], start: int, expected: list[bytes]) -> list[torch.Tensor]:
    """On the engine thread: per layer, a copy of K and V of the blocks [start, start + n) of
    this prompt ([2, n, block_size, kv_heads, head_dim]) from the cache or the second tier."""
    hashes = engine.hasher.hash_blocks(token_ids)[start:]
    if hashes != expected:
        raise BlocksNotHeldError(
            "the requested block hashes are not this worker's hashes of the prompt "
            "(another model, block size or hash version)"
        )
    kv_caches = engine.kv_connector.kv_caches
    held, cached = _held_payloads(engine, hashes)
    per_block = []
    for i, block_hash in enumerate(hashes):
        if held[i]:
            per_block.append(next(cached))
            continue
        kv = (
            engine.kv_tier.store.get(block_hash)
            if engine.kv_tier is not None and engine.kv_tier.holds(block_hash)
            else None
        )
        if kv is None:
            raise BlocksNotHeldError(f"block {start + i} of the prompt is no longer cached here (evicted)")
        per_block.append(kv.to(kv_caches[0][0].device))
    stacked = torch.stack(per_block)  # [n, layers, 2, block_size, kv_heads, head_dim]
    return [stacked[:, layer].transpose(0, 1).contiguous() for layer in range(len(kv_caches))]


def _held_payloads(engine, hashes: list[bytes]):
    """Which of the prompt's blocks the cache holds (for a model with KV groups, in every
    layer's group: platform/kv/groups.py), and an iterator over their payloads, in order."""
    layer_group = engine.kv_connector.layer_group
    if not layer_group:
        blocks = [engine.pool.lookup(h) for h in hashes]
        return [b is not None for b in blocks], _cached_payloads(engine, [b.block_id for b in blocks if b is not None])
    if engine.tensor_parallel_size > 1:  # the gather reads one block list for every layer
        raise BlocksNotHeldError("a pull from a model with KV groups under tensor parallelism is not supported")
    kv_caches = engine.kv_connector.kv_caches
    groups = [[engine.pool.lookup(h, g) for g in layer_group] for h in hashes]
    held = [all(b is not None for b in blocks) for blocks in groups]
    payloads = (
        torch.stack([torch.stack((k[b.block_id], v[b.block_id])) for (k, v), b in zip(kv_caches, blocks)])
        for blocks, ok in zip(groups, held)
        if ok
    )
    return held, payloads


def _cached_payloads(engine, block_ids: list[int]):
    """Each of `block_ids`' KV in the cache, in order, [layers, 2, block_size, kv_heads, head_dim];
    under tensor parallelism every rank's heads, gathered to rank 0 at once (engine/kv_parallel.py)."""
    kv_caches = engine.kv_connector.kv_caches
    if engine.tensor_parallel_size == 1:
        return (torch.stack([torch.stack((k[b], v[b])) for k, v in kv_caches]) for b in block_ids)
    if not block_ids:
        return iter(())
    layers = engine.kv_connector.read_blocks(block_ids)  # per layer [2, n, block_size, kv_heads, head_dim]
    return iter(torch.stack(layers).permute(2, 0, 1, 3, 4, 5))


# -- the puller ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PullOutcome:
    num_tokens: int  # prompt tokens whose KV arrived (0: the pull failed or was not tried)
    seconds: float


class KVPuller:
    def __init__(
        self,
        engine: AsyncEngine,
        receiver: KVReceiver,
        layout: KVLayout,
        deadline_s: float,
        max_pull_blocks: int,
        metrics=None,
        kv_address: str = "",
        tls: TlsFiles | None = None,
    ):
        self.engine = engine
        self.receiver = receiver
        self.kv_address = kv_address or receiver.address
        self.layout = layout
        self.deadline_s = deadline_s
        self.max_pull_blocks = max_pull_blocks
        self.metrics = metrics
        self.stubs = ChannelPool(tls, [("grpc.max_receive_message_length", 64 << 20)], idle_s=300.0)

    async def run(self, req_id: str, token_ids: list[int], ready: KVReady, pull: pb.KVPull) -> PullOutcome:
        """Pull what `pull` offers beyond this worker's own hits, then let the engine prefill the
        rest (always: on failure from the hits alone)."""
        bs = self.layout.block_size
        start = ready.start_block
        end = min(pull.num_blocks, (len(token_ids) - 1) // bs, start + self.max_pull_blocks)
        if end <= start:
            self.engine.fallback_to_local_prefill(req_id)
            return PullOutcome(0, 0.0)
        t0 = time.monotonic()
        ok = await self._attempt(pull.holder, req_id, token_ids, ready.block_ids[start:end], start)
        seconds = time.monotonic() - t0
        self.engine.fallback_to_local_prefill(req_id, end * bs if ok else None)
        if self.metrics is not None:
            self.metrics.kv_pulls.labels(outcome="ok" if ok else "failed").inc()
            self.metrics.kv_pull_seconds.observe(seconds)
            if ok:
                self.metrics.kv_pull_blocks.labels(direction="in").inc(end - start)
        return PullOutcome((end - start) * bs if ok else 0, seconds)

    async def _attempt(self, holder: str, req_id: str, token_ids: list[int], dst: tuple[int, ...], start: int) -> bool:
        transfer_id = f"{req_id}/pull/{uuid.uuid4().hex[:12]}"
        num_tokens = (start + len(dst)) * self.layout.block_size
        hashes = await self.engine.call(lambda e: e.hasher.hash_blocks(token_ids[:num_tokens]))
        received: dict[int, hashlib._Hash] = {}
        write = self.engine.write_kv_layer

        def on_layer(layer, payload, first):
            received.setdefault(layer, hashlib.sha256()).update(
                payload.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
            )
            write(dst[first : first + payload.shape[1]], layer, payload)

        self.receiver.expect(transfer_id, self.layout, len(dst), on_layer, self.deadline_s)
        try:
            resp = await self.stubs.stub(holder).Prefill(
                pb.PrefillRequest(
                    request_id=req_id,
                    prompt_token_ids=token_ids,
                    skip_blocks=start,
                    num_blocks=len(dst),
                    block_hashes=hashes[start:],
                    cached_only=True,
                    kv_address=self.kv_address,
                    transfer_id=transfer_id,
                    layout=pb.KVLayout(**self.layout.to_dict()),
                    deadline_s=self.deadline_s,
                ),
                timeout=self.deadline_s,
            )
            status = await asyncio.wait_for(self.receiver.wait(transfer_id), timeout=self.deadline_s)
            if status.state != TransferState.DONE:
                raise TransferError(f"transfer ended {status.state.name}: {status.error}")
            got = [received[layer].digest() for layer in sorted(received)]
            if got != list(resp.layer_digests):
                raise TransferError("a pulled layer differs from what the holder sent (digest mismatch): discarded")
        except (TimeoutError, grpc.aio.AioRpcError, TransferError) as exc:
            self.receiver.abort(transfer_id)
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
                await self.stubs.drop(holder)
            log.warning(
                "request %s: pull from %s failed, recomputing (%s)",
                req_id,
                holder,
                f"{exc.code().name}: {exc.details()}"
                if isinstance(exc, grpc.aio.AioRpcError)
                else "deadline exceeded"
                if isinstance(exc, asyncio.TimeoutError)
                else exc,
            )
            return False
        except BaseException:  # cancelled by the client: stop the transfer; the caller frees the request
            self.receiver.abort(transfer_id)
            raise
        finally:
            self.receiver.release(transfer_id)
        return True

    async def close(self) -> None:
        await self.stubs.close()
