"""The decode worker's side of a disaggregated request (docs/workers.md).

The engine has allocated blocks for the whole prompt and reused this worker's own prefix-cache
hits (KVReady). For each prefill worker the router offered, in order:

1. register the expected transfer with the KV receiver (layout, block count, a writer into
   exactly the blocks that are missing here) and a deadline;
2. call Prefill(skip_blocks = blocks cached here, our KV address, transfer id, layout);
   the prefill worker pushes each layer as soon as it is computed and answers with the first
   token only after our receiver acknowledged every layer;
3. on success, hand the first token to the engine, which starts decoding.

Any failure — the prefill worker unreachable, erroring, killed mid-transfer, silent past the
deadline, or a layout mismatch — aborts that transfer (late bytes are discarded, never written)
and moves on to the next prefill worker; over CUDA IPC, where a sender writes the blocks itself,
an aborted transfer's blocks are quarantined (workers/transfer/quarantine.py): the engine holds them
until the receiver lifts it, and the next attempt waits for that. When no prefill worker is left
the engine prefills locally in the blocks it already holds. A cancelled client request cancels
the Prefill call (the prefill worker then frees its blocks) and aborts the transfer; the engine
frees ours (quarantined ones once the receiver lifts the quarantine).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

import grpc

from splitserve.platform.engine.async_engine import AsyncEngine
from splitserve.platform.engine.kv_handoff import KVReady
from splitserve.platform.observability import tracing
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire.grpc_channels import ChannelPool
from splitserve.platform.wire.grpc_tls import TlsFiles
from splitserve.workers import wire
from splitserve.workers.transfer.base import KVLayout, KVReceiver, TransferError, TransferState

log = logging.getLogger(__name__)


class RemotePrefill:
    def __init__(
        self,
        engine: AsyncEngine,
        receiver: KVReceiver,
        layout: KVLayout,
        deadline_s: float,
        metrics=None,
        kv_address: str = "",
        tls: TlsFiles | None = None,
    ):
        self.engine = engine
        self.receiver = receiver
        self.kv_address = kv_address or receiver.address  # what the prefill worker dials
        self.layout = layout
        self.deadline_s = deadline_s
        self.metrics = metrics
        # Channels to prefill workers: dropped after a failed call or 5 idle minutes (grpc_channels).
        self.stubs = ChannelPool(tls, [("grpc.max_receive_message_length", 64 << 20)], idle_s=300.0)
        self._holds: set[asyncio.Task] = set()  # quarantined blocks, released when the receiver lifts them

    async def run(
        self,
        req_id: str,
        token_ids: list[int],
        params: SamplingParams,
        ready: KVReady,
        prefill_workers: list[str],
        lora=None,
        span=tracing.NOOP,
    ) -> tuple[str, pb.PrefillResponse | None]:
        """Fill the request's missing KV from a prefill worker; returns its address and answer,
        or ("", None) when the request fell back to local prefill. `lora`: the request's
        LoraAdapter (its name, folder and digest go along; a prefill worker that cannot run
        the same weights refuses, and the next one is tried). `span`: the request's remote-prefill
        span; each attempt is a child whose context goes to the prefill worker in the metadata."""
        for address in prefill_workers:
            with span.child("prefill.call", kind="client", attributes={"server.address": address}) as call:
                resp = await self._attempt(address, req_id, token_ids, params, ready, lora, call)
            if resp is not None:
                return address, resp
        self.engine.fallback_to_local_prefill(req_id)
        self._count("local_fallback")
        return "", None

    async def _attempt(
        self, address, req_id, token_ids, params, ready: KVReady, lora=None, call=tracing.NOOP
    ) -> pb.PrefillResponse | None:
        transfer_id = f"{req_id}/{uuid.uuid4().hex[:12]}"
        call.set("splitserve.kv.transfer_id", transfer_id)
        dst, layout = self._expect(transfer_id, ready, lora)
        t0 = time.monotonic()
        receive = call.child(
            "kv.receive",
            start=t0,
            attributes={
                "splitserve.kv.transfer_id": transfer_id,
                "splitserve.kv.num_blocks": len(dst),
                "splitserve.kv.path": self.kv_address.partition("://")[0] or "unknown",
            },
        )
        try:
            resp = await self.stubs.stub(address).Prefill(
                self._request(req_id, token_ids, params, ready, transfer_id, layout, lora),
                timeout=self.deadline_s,
                metadata=tracing.outgoing_metadata(call),
            )
            status = await asyncio.wait_for(self.receiver.wait(transfer_id), timeout=self.deadline_s)
            receive.set("splitserve.kv.num_bytes", status.num_bytes)
            if status.state != TransferState.DONE:
                raise TransferError(f"transfer ended {status.state.name}: {status.error}")
        except (TimeoutError, grpc.aio.AioRpcError, TransferError) as exc:
            receive.fail(exc)
            call.fail(exc)
            lifted = self._abort(transfer_id, dst)
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
                await self.stubs.drop(address)  # gone or restarting: the next request dials afresh
            log.warning("request %s: remote prefill on %s failed (%s)", req_id, address, _describe(exc))
            self._count("failed")
            if lifted is not None:  # the next attempt, or the local prefill, writes these blocks again
                await lifted.wait()
            return None
        except BaseException:  # cancelled by the client: stop the transfer, let the caller clean up
            self._abort(transfer_id, dst)
            raise
        finally:
            receive.end()
            self.receiver.release(transfer_id)
        self._observe(status.num_bytes, time.monotonic() - t0)
        logprob = wire.logprob_from_proto(resp.logprob) if resp.HasField("logprob") else None
        self.engine.complete_remote_prefill(req_id, resp.first_token_id, logprob)
        self._count("ok")
        return resp

    def _expect(self, transfer_id: str, ready: KVReady, lora) -> tuple:
        """Register the transfer with the receiver: its blocks land in the request's blocks from
        `ready.start_block` on. Returns those block ids and the layout the prefill must match."""
        dst = ready.block_ids[ready.start_block :]
        write = self.engine.write_kv_layer
        # The adapter is part of the layout: KV computed with other weights is refused (prefill.py).
        layout = dataclasses.replace(self.layout, lora_digest=lora.digest.hex() if lora else "")
        self.receiver.expect(
            transfer_id,
            layout,
            len(dst),
            lambda layer, payload, first: write(dst[first : first + payload.shape[1]], layer, payload),
            self.deadline_s,
            # KV groups (ready.layer_skip): sliding-window layers get only their window, through
            # write_kv_layer (CUDA IPC would write every layer into group 0's blocks)
            block_ids=None if ready.layer_skip else dst,
            layer_skip=ready.layer_skip,
        )
        return dst, layout

    def _abort(self, transfer_id: str, block_ids) -> asyncio.Event | None:
        """Abort the transfer. If a CUDA IPC sender may still write its blocks (the receiver's
        quarantine), the engine holds them, so no other request gets them, until the receiver
        lifts it; returns the event that says so, or None. Called while the request still holds
        the blocks: its own abort (a client gone) is queued to the engine after the hold."""
        self.receiver.abort(transfer_id)
        lifted = self.receiver.quarantine(transfer_id)
        if lifted is None:
            return None
        self.engine.hold_blocks(block_ids)
        task = asyncio.ensure_future(self._release_when(lifted, block_ids))
        self._holds.add(task)
        task.add_done_callback(self._holds.discard)
        return lifted

    async def _release_when(self, lifted: asyncio.Event, block_ids) -> None:
        await lifted.wait()
        self.engine.release_blocks(block_ids)

    def _request(self, req_id, token_ids, params, ready: KVReady, transfer_id: str, layout, lora):
        """The PrefillRequest of one attempt: the blocks from `ready.start_block` on, to this receiver."""
        return pb.PrefillRequest(
            request_id=req_id,
            prompt_token_ids=token_ids,
            params=wire.sampling_params_to_proto(params),
            skip_blocks=ready.start_block,
            kv_address=self.kv_address,
            transfer_id=transfer_id,
            layout=pb.KVLayout(**layout.to_dict()),
            deadline_s=self.deadline_s,
            lora_name=lora.name if lora else "",
            lora_path=lora.path if lora else "",
        )

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.remote_prefills.labels(outcome=outcome).inc()

    def _observe(self, num_bytes: int, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.kv_transfer_bytes.labels(direction="in").observe(num_bytes)
            self.metrics.kv_transfer_seconds.labels(direction="in").observe(seconds)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, asyncio.TimeoutError):
        return "deadline exceeded"
    return str(exc)
