"""The prefill worker's side of a disaggregated request.

Prefill(prompt, skip_blocks, kv_address, transfer_id, layout) runs the prompt through this
worker's engine — reusing its own prefix cache — as a one-token request whose KV export hook
copies each layer's blocks [skip_blocks, n) the moment that layer is computed: with chunked
prefill, each chunk's completed blocks. A pump task sends those payloads over the KV transport
while the next layers (and chunks) compute, so transfer overlaps compute. The answer (the
first sampled token) goes back only after the decode worker acknowledged every layer; if the
caller cancels, or anything fails, the transfer is aborted and the engine request freed, so no
blocks stay held.

A LoRA request names its adapter and the folder it came from, and its layout carries the
adapter's digest (KVLayout.lora_digest): the prefill worker uses its own copy when the digests
match, otherwise reads the folder (when it can); weights that still differ are a layout
mismatch (the KV would not be the decode worker's), and the decode worker falls back to
prefilling locally. The layout sent with the KV carries this worker's digest, so the decode
worker's receiver checks it once more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from splitserve.platform.engine.async_engine import AsyncEngine
from splitserve.platform.engine.kv_handoff import KVExport
from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.observability import tracing
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.workers import faults, wire
from splitserve.workers.transfer.base import KVLayout, KVSender, LayoutMismatchError, SendHandle

log = logging.getLogger(__name__)


async def serve_prefill(
    engine: AsyncEngine,
    sender: KVSender,
    layout: KVLayout,
    request: pb.PrefillRequest,
    metrics=None,
    streaming: bool = True,
    span=tracing.NOOP,
) -> pb.PrefillResponse:
    """Raises InvalidRequestError (bad input), LayoutMismatchError, TransferError.

    `span` (the request's span on this worker) gets the children prefill.queue, prefill.compute
    and kv.send (with the transfer id, bytes, blocks and path).

    `streaming=False` holds every layer until the prompt is computed (the baseline that
    per-layer streaming is measured against).
    """
    if faults.PREFILL_HANG:
        await asyncio.Event().wait()
    job = await _prepare(engine, layout, request)
    t0 = time.monotonic()
    send = span.child("kv.send", start=t0, attributes=_send_attributes(request, job.num_blocks))
    try:
        handle = await sender.open(request.kv_address, request.transfer_id, job.layout, job.num_blocks)
    except BaseException as exc:
        send.fail(exc)
        send.end()
        raise
    if job.layer_skip:
        handle.skip_leading(job.layer_skip)
    pump = KVPump(handle, job.layout.num_layers, job.num_blocks, job.layer_skip)
    try:
        final, t_computed = await pump.run(engine, job, request, streaming)
    except BaseException as exc:
        await pump.abort()
        send.fail(exc)
        send.end()
        raise
    t_acked = time.monotonic()
    send.set("splitserve.kv.num_bytes", handle.bytes_sent)
    send.set("splitserve.kv.path", handle.path or "unknown")  # cuda_ipc, or the transport's scheme
    send.end(t_acked)
    _trace_compute(span, final, t0, t_computed)
    if metrics is not None:
        metrics.kv_transfer_bytes.labels(direction="out").observe(handle.bytes_sent)
        metrics.kv_transfer_seconds.labels(direction="out").observe(t_acked - t0)
        metrics.kv_transfers.labels(path=handle.path).inc()
    resp = pb.PrefillResponse(
        first_token_id=final.new_token_ids[0],
        cached_tokens=final.num_cached_tokens,
        kv_bytes=handle.bytes_sent,
        prefill_s=t_computed - t0,
        transfer_wait_s=t_acked - t_computed,
    )
    if final.new_logprobs:
        resp.logprob.CopyFrom(wire.logprob_to_proto(final.new_logprobs[0]))
    return resp


@dataclasses.dataclass(frozen=True)
class PrefillJob:
    """A checked Prefill request: what to run and which blocks to send."""

    token_ids: list[int]
    params: object  # SamplingParams: the first token only
    lora_name: str | None
    layout: KVLayout  # this worker's, with its adapter's digest
    num_blocks: int  # blocks [skip_blocks, skip_blocks + num_blocks) of the prompt go out
    layer_skip: tuple[int, ...] = ()  # per layer, of those the leading ones not sent (KV groups' windows)


async def _prepare(engine: AsyncEngine, layout: KVLayout, request: pb.PrefillRequest) -> PrefillJob:
    """The request checked (InvalidRequestError, LayoutMismatchError) and turned into a PrefillJob."""
    token_ids = wire.prompt_token_ids(
        request.request_id, request.prompt_token_ids, engine.model_config.vocab_size, engine.max_model_len
    )
    if not request.transfer_id or not request.kv_address:
        raise InvalidRequestError("transfer_id and kv_address are required for Prefill")
    theirs = _request_layout(request)
    layout.check_compatible(dataclasses.replace(theirs, lora_digest=""))  # the model's shape first
    lora_name, layout = await _same_adapter(engine, request, layout, theirs)
    params = wire.sampling_params(request.params)
    # Only the first token is sampled here; stop strings and logprob width follow the request.
    params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=())
    num_blocks = -(-len(token_ids) // layout.block_size) - request.skip_blocks
    if num_blocks <= 0 or request.skip_blocks < 0:
        raise InvalidRequestError(
            f"skip_blocks={request.skip_blocks} is invalid for a prompt of {len(token_ids)} "
            f"tokens; allowed: 0 to {-(-len(token_ids) // layout.block_size) - 1}"
        )
    layer_skip = engine.kv_layer_skip(len(token_ids), request.skip_blocks)
    return PrefillJob(token_ids, params, lora_name, layout, num_blocks, layer_skip)


def _send_attributes(request: pb.PrefillRequest, num_blocks: int) -> dict:
    return {
        "splitserve.kv.transfer_id": request.transfer_id,
        "splitserve.kv.num_blocks": num_blocks,
        "splitserve.kv.path": request.kv_address.partition("://")[0] or "unknown",
        "server.address": request.kv_address,
    }


def _trace_compute(span, final, t0: float, t_computed: float) -> None:
    if final.first_scheduled_time is not None:
        span.record("prefill.queue", t0, final.first_scheduled_time)
        span.record(
            "prefill.compute",
            final.first_scheduled_time,
            t_computed,
            {"splitserve.cached_tokens": final.num_cached_tokens},
        )
    span.update({"gen_ai.usage.output_tokens": 1, "splitserve.cached_tokens": final.num_cached_tokens})


class KVPump:
    """One Prefill's KV on its way out: the engine thread hands each layer's staged blocks to
    `sink`; `pump` sends them (the one caller of the handle's send_layer) until every (layer,
    block) pair went. After a failure (`abort`) whatever still arrives goes straight back to the
    buffer pool, so no staged buffer is held."""

    def __init__(self, handle: SendHandle, num_layers: int, num_blocks: int, layer_skip: tuple[int, ...] = ()):
        self.handle = handle
        self.num_blocks = num_blocks
        # (layer, block) pairs still to send; a sliding-window layer of a model with KV groups
        # sends only the blocks of its window (`layer_skip`, the engine's KVConnector.layer_skip)
        self.num_pending = num_layers * num_blocks - sum(layer_skip)
        self.loop = asyncio.get_running_loop()
        self.layers: asyncio.Queue = asyncio.Queue()
        self.is_closed = False
        self.task: asyncio.Task | None = None

    def sink(self, layer: int, payload, first_block: int) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self._deliver, (layer, payload, first_block))

    def _deliver(self, item) -> None:
        if self.is_closed:
            item[1].release()
        else:
            self.layers.put_nowait(item)

    async def pump(self) -> None:
        while self.num_pending:
            layer, staged, first_block = await self.layers.get()
            try:
                if not staged.ready.is_ready():  # the device copy (CUDA): waited for here, never on the engine thread
                    await asyncio.to_thread(staged.ready.wait)
                await self.handle.send_layer(layer, staged.tensor, first_block, on_sent=staged.release)
            except BaseException:
                staged.release()
                raise
            self.num_pending -= staged.num_blocks
            if first_block + staged.num_blocks == self.num_blocks:
                faults.after_layer_sent(layer)

    async def run(self, engine: AsyncEngine, job: PrefillJob, request: pb.PrefillRequest, streaming: bool):
        """Compute the prompt while the pump sends (or after, without `streaming`), then wait for
        the receiver's ack; the final output and when the compute ended."""
        self.task = asyncio.create_task(self.pump()) if streaming else None
        final = None
        async for out in engine.generate(
            params=job.params,
            prompt_token_ids=job.token_ids,
            req_id=f"prefill/{request.transfer_id}",
            kv_export=KVExport(request.skip_blocks, self.sink, on_device=self.handle.wants_device_payloads),
            lora_name=job.lora_name,
        ):
            final = out
        if final is None or not final.new_token_ids:
            raise InvalidRequestError(f"prefill of {request.request_id} was aborted")
        t_computed = time.monotonic()
        if self.task is None:  # the baseline: nothing leaves before the whole prompt is computed
            self.task = asyncio.create_task(self.pump())
        await asyncio.wait_for(self.task, timeout=request.deadline_s or None)
        await self.handle.finish()
        return final, t_computed

    async def abort(self) -> None:
        """After a failure or cancellation: stop sending, tell the receiver, free what is queued."""
        if self.task is not None:
            self.task.cancel()
        await self.handle.abort()
        self.is_closed = True
        while not self.layers.empty():
            self.layers.get_nowait()[1].release()


def _request_layout(request: pb.PrefillRequest) -> KVLayout:
    try:
        return KVLayout.from_dict(
            dict(
                model_id=request.layout.model_id,
                dtype=request.layout.dtype,
                block_size=request.layout.block_size,
                num_layers=request.layout.num_layers,
                num_kv_heads=request.layout.num_kv_heads,
                head_dim=request.layout.head_dim,
                weights=request.layout.weights or "none",
                lora_digest=request.layout.lora_digest,
            )
        )
    except ValueError as exc:
        raise InvalidRequestError(f"bad KV layout in the prefill request: {exc}") from None


async def _same_adapter(
    engine: AsyncEngine, request: pb.PrefillRequest, layout: KVLayout, theirs: KVLayout
) -> tuple[str | None, KVLayout]:
    """The adapter name to prefill with and this worker's layout for the request (its adapter's
    digest in it), after loading the decode worker's folder when this worker holds other weights
    under that name (or none). LayoutMismatchError when the digests still differ."""
    if not request.lora_name and not theirs.lora_digest:
        return None, layout
    name, path, digest = request.lora_name, request.lora_path, theirs.lora_digest
    why = ""

    def ensure(eng) -> str:
        nonlocal why
        known = {n: d.hex() for n, d, _ in eng.loras.known()}
        if known.get(name) != digest and path:
            try:
                adapter = eng.load_lora_adapter(name, path)
                log.info("loaded LoRA adapter %s from %s for a prefill", name, path)
                return adapter.digest.hex()
            except InvalidRequestError as exc:
                why = f" (adapter {name!r} could not be loaded here from {path!r}: {exc})"
        return known.get(name, "")

    mine = dataclasses.replace(layout, lora_digest=await engine.call(ensure) if name else "")
    try:
        mine.check_compatible(theirs)
    except LayoutMismatchError as exc:
        raise LayoutMismatchError(f"{exc}{why}", exc.mismatches) from None
    return name or None, mine
