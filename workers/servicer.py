"""The Worker gRPC service: Generate, Prefill, Abort, WatchEvents, Load/UnloadLoraAdapter
(proto/splitserve/v1).

A Generate for a LoRA adapter (`lora_name`) the worker does not know is NOT_FOUND; its remote
prefill carries the adapter's name, folder and digest, so the prefill worker runs the same
weights (serve_prefill) or refuses, and the request falls back to local prefill.

Bad input gets INVALID_ARGUMENT (or NOT_FOUND / FAILED_PRECONDITION) with a message, and the
worker keeps serving: each error type a caller can cause has one status, in the table
`_STATUS_BY_ERROR` (callers match on the status, never on the message). While draining, new work
gets UNAVAILABLE so the router retries elsewhere; work already accepted finishes.

Where a Generate's prompt KV comes from is `_prefill_source`: computed here (LOCAL), pulled from
another decode worker's cache (PULL) or pushed by a prefill worker (REMOTE).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time

import grpc

from splitserve.platform.engine.async_engine import AsyncEngine
from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.lora.adapter import AdapterFolderNotFoundError
from splitserve.platform.lora.registry import AdapterNotFoundError
from splitserve.platform.observability import tracing
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc
from splitserve.platform.wire.disaggregation import mode_name
from splitserve.workers import faults, wire
from splitserve.workers.config import WorkerConfig
from splitserve.workers.decode import RemotePrefill
from splitserve.workers.events import EventHub
from splitserve.workers.generate_observer import GenerateObserver
from splitserve.workers.kv_pull import BlocksNotHeldError, KVPuller, serve_cached
from splitserve.workers.prefill import serve_prefill
from splitserve.workers.records import RequestRecords
from splitserve.workers.transfer.base import (
    KVLayout,
    KVSender,
    LayoutMismatchError,
    TransferError,
    UnknownTransferError,
)

log = logging.getLogger(__name__)

# The gRPC status of each error a caller can cause, with the message's prefix; the first type that
# matches wins, so a subclass comes before its base (AdapterNotFoundError is an InvalidRequestError,
# UnknownTransferError and LayoutMismatchError are TransferErrors).
_STATUS_BY_ERROR: tuple[tuple[type[Exception], grpc.StatusCode, str], ...] = (
    (AdapterNotFoundError, grpc.StatusCode.NOT_FOUND, ""),
    (AdapterFolderNotFoundError, grpc.StatusCode.NOT_FOUND, ""),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (BlocksNotHeldError, grpc.StatusCode.FAILED_PRECONDITION, "pull refused: "),
    (LayoutMismatchError, grpc.StatusCode.FAILED_PRECONDITION, "KV layout mismatch: "),
    (UnknownTransferError, grpc.StatusCode.NOT_FOUND, "KV transfer failed: "),
    (TransferError, grpc.StatusCode.UNAVAILABLE, "KV transfer failed: "),
)


def grpc_status(exc: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status and message a caller gets for `exc`; None for an error of ours (gRPC says UNKNOWN)."""
    for error_type, code, prefix in _STATUS_BY_ERROR:
        if isinstance(exc, error_type):
            return code, f"{prefix}{exc}"
    return None


@contextlib.asynccontextmanager
async def _caller_errors(context):
    """Ends the RPC with `grpc_status`'s status for an error a caller caused; any other error propagates."""
    try:
        yield
    except Exception as exc:
        status = grpc_status(exc)
        if status is None:
            raise
        await context.abort(*status)


class PrefillSource(enum.Enum):
    """Where a Generate's prompt KV comes from."""

    LOCAL = "local"  # this decode worker computes it
    PULL = "pull"  # copied from another decode worker that holds the prefix (workers/kv_pull.py)
    REMOTE = "remote"  # computed by a prefill worker and pushed here (workers/decode.py)


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(
        self,
        config: WorkerConfig,
        engine: AsyncEngine,
        hub: EventHub,
        remote: RemotePrefill | None,
        sender: KVSender | None,
        layout: KVLayout,
        metrics,
        puller: KVPuller | None = None,
    ):
        self.config = config
        self.engine = engine
        self.hub = hub
        self.remote = remote
        self.sender = sender
        self.layout = layout
        self.metrics = metrics
        self.puller = puller  # None: pulls off (--no-kv-pull) or no KV receiver (prefill role)
        self.records = RequestRecords()  # /debug/requests/<id>, `splitserve trace`
        self.draining = False
        self.num_inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    # -- admission -------------------------------------------------------------------------
    async def _admit(self, context, allowed_roles: tuple[str, ...], rpc: str) -> None:
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "worker is draining (shutting down); retry on another worker"
            )
        if self.config.role not in allowed_roles:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{rpc} is not served by a {self.config.role} worker; allowed roles: {', '.join(allowed_roles)}",
            )

    def _enter(self) -> None:
        self.num_inflight += 1
        self.idle.clear()

    def _leave(self) -> None:
        self.num_inflight -= 1
        if self.num_inflight == 0:
            self.idle.set()

    # -- Generate --------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context):
        await self._admit(context, ("decode", "both"), "Generate")
        async with _caller_errors(context):
            token_ids = wire.prompt_token_ids(
                request.request_id,
                request.prompt_token_ids,
                self.engine.model_config.vocab_size,
                self.engine.max_model_len,
            )
            params = wire.sampling_params(request.params)
            lora = await self._adapter(request.lora_name, request.lora_evict_first)
            source = await self._prefill_source(request, params, token_ids, lora)
        span = self._request_span("worker.generate", request, context, token_ids)
        self._enter()
        try:
            # An adapter unloaded between the check and the admission is NOT_FOUND here too.
            async with _caller_errors(context):
                async for msg in self._generate(request, token_ids, params, source, lora, span):
                    yield msg
        except BaseException as exc:  # an error, or cancelled by the caller: the span says so
            span.fail(exc)
            raise
        finally:
            span.end()
            self._leave()

    def _request_span(self, name: str, request, context, token_ids):
        """This worker's span of one request, a child of the caller's `traceparent` (gRPC
        metadata), with OpenTelemetry's gen_ai attributes; NOOP when tracing is off."""
        tracer = tracing.tracer()
        if not tracer.enabled:
            return tracing.NOOP
        span = tracer.start(
            name,
            tracing.metadata_carrier(context.invocation_metadata()),
            attributes={
                "gen_ai.operation.name": "text_completion",
                "gen_ai.system": "splitserve",
                "gen_ai.request.model": request.lora_name or self.engine.model_config.model_id,
                "gen_ai.request.max_tokens": request.params.max_tokens or None,
                "gen_ai.usage.input_tokens": len(token_ids),
                "splitserve.request_id": request.request_id,
                "splitserve.role": self.config.role,
            },
        )
        if tracer.include_prompt:
            span.set("gen_ai.prompt.token_ids", list(token_ids))
        span.activate()
        return span

    async def _prefill_source(self, request: pb.GenerateRequest, params, token_ids: list[int], lora) -> PrefillSource:
        """LOCAL when the prompt is needed here: a resume (tokens already streamed elsewhere), prompt
        logprobs (its logits) or an embedding (its hidden states). PULL when the router planned one
        (kv_pull) for the base model and this worker can receive KV. REMOTE when prefill workers are
        listed and the disaggregation mode says so (`_wants_remote`); LOCAL otherwise."""
        if request.resume_output_token_ids or params.prompt_logprobs is not None or params.embed:
            return PrefillSource.LOCAL
        if request.HasField("kv_pull") and request.kv_pull.holder and self.puller is not None and lora is None:
            return PrefillSource.PULL
        if await self._wants_remote(request, token_ids):
            return PrefillSource.REMOTE
        return PrefillSource.LOCAL

    async def _adapter(self, name: str, evict_first=()):
        """The adapter named by a request (None for ""), looked up on the engine thread. One that
        was evicted from memory is read again in another thread: the engine keeps stepping the
        other requests meanwhile (platform/lora/registry.py). Keeping it evicts, if memory is
        full, one of `evict_first` (the router's hint: adapters other workers also hold) first."""
        if not name:
            return None
        adapter, path = await self.engine.call(lambda e: e.loras.lookup(name))
        if adapter is None:
            t0 = time.monotonic()
            adapter = await asyncio.to_thread(_read_adapter, self.engine, name, path)
            self.metrics.lora_reads.inc()
            self.metrics.lora_read_seconds.inc(time.monotonic() - t0)
            evict_first = tuple(evict_first)

            def keep(e):
                before = e.loras.num_hinted_evictions
                return e.loras.install(adapter, evict_first), e.loras.num_hinted_evictions - before

            adapter, hinted = await self.engine.call(keep)
            self.metrics.lora_hinted_evictions.inc(hinted)
        return adapter

    async def _generate(
        self,
        request: pb.GenerateRequest,
        token_ids: list[int],
        params,
        source: PrefillSource,
        lora=None,
        span=tracing.NOOP,
    ):
        observer = GenerateObserver(
            self.metrics,
            self.records,
            request.request_id,
            self.config.role,
            lora.name if lora else "",
            len(token_ids),
            remote_prefill=source is PrefillSource.REMOTE,
            span=span,
        )
        prefill_worker = ""
        async for out in self.engine.generate(
            prompt_token_ids=token_ids,
            params=params,
            req_id=request.request_id,
            remote_prefill=source is not PrefillSource.LOCAL,
            resume_output_token_ids=list(request.resume_output_token_ids),
            lora_name=lora.name if lora else None,
            priority=request.priority,
            band=request.band,
        ):
            if out.kv_ready is not None:
                observer.on_kv_ready()
                prefill_worker = await self._land_kv(request, token_ids, params, source, out.kv_ready, lora, observer)
                continue
            msg = wire.generate_response(out, prefill_worker)
            msg.usage.pulled_tokens = observer.num_pulled_tokens
            observer.on_token(out, msg, prefill_worker)
            yield msg

    async def _land_kv(self, request, token_ids, params, source, kv_ready, lora, observer: GenerateObserver) -> str:
        """Bring the prompt's KV into the blocks `kv_ready` names: pulled from the decode worker
        that holds it (PULL), or pushed by a prefill worker (REMOTE; on failure the engine
        prefills locally). The prefill worker that served it ("" for a pull or a fallback)."""
        span = observer.span
        if source is PrefillSource.PULL:
            pull = request.kv_pull
            with span.child("kv.pull", attributes={"splitserve.kv.holder": pull.holder}) as pull_span:
                outcome = await self.puller.run(request.request_id, token_ids, kv_ready, pull)
                pull_span.set("splitserve.kv.pulled_tokens", outcome.num_tokens)
            observer.on_kv_landed(kv_pull_s=outcome.seconds, num_pulled_tokens=outcome.num_tokens)
            return ""
        with span.child("worker.remote_prefill") as wait:
            prefill_worker, resp = await self.remote.run(
                request.request_id, token_ids, params, kv_ready, list(request.prefill_workers), lora, span=wait
            )
            wait.set("splitserve.prefill_worker", prefill_worker or "local fallback")
        if resp is None:
            observer.on_kv_landed()
        else:
            observer.on_kv_landed(prefill_s=resp.prefill_s, transfer_wait_s=resp.transfer_wait_s)
        return prefill_worker

    async def _wants_remote(self, request: pb.GenerateRequest, token_ids: list[int]) -> bool:
        if not request.prefill_workers or self.remote is None:
            return False
        mode = mode_name(request.disaggregation, self.config.disaggregation)
        if mode == "never":
            return False
        if mode == "always":
            return True
        threshold = (
            request.min_prefill_tokens if request.HasField("min_prefill_tokens") else self.config.min_prefill_tokens
        )
        try:
            # Asked on the engine thread, the prefix cache's only reader and writer.
            cached = await self.engine.call(lambda e: e.num_cached_prefix_tokens(token_ids, request.lora_name or None))
        except AdapterNotFoundError:
            return False  # unloaded since the check: admission answers NOT_FOUND
        uncached = len(token_ids) - cached
        return uncached >= threshold

    # -- Prefill ---------------------------------------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest, context):
        await self._admit(context, ("prefill", "both"), "Prefill")
        span = self._request_span(
            "prefill.serve_cached" if request.cached_only else "prefill.request",
            request,
            context,
            request.prompt_token_ids,
        )
        span.set("splitserve.kv.transfer_id", request.transfer_id)
        self._enter()
        try:
            async with _caller_errors(context):
                with span:  # ends it; an exception marks it failed
                    if request.cached_only:
                        return await serve_cached(self.engine, self.sender, self.layout, request, self.metrics)
                    resp = await serve_prefill(
                        self.engine,
                        self.sender,
                        self.layout,
                        request,
                        self.metrics,
                        streaming=self.config.kv_layer_streaming,
                        span=span,
                    )
                    self.records.update(
                        request.request_id,
                        role=self.config.role,
                        prefill_s=resp.prefill_s,
                        transfer_wait_s=resp.transfer_wait_s,
                        kv_bytes=resp.kv_bytes,
                        transfer_id=request.transfer_id,
                        num_prompt_tokens=len(request.prompt_token_ids),
                        num_cached_tokens=resp.cached_tokens,
                        trace_id=span.trace_id or None,
                    )
                    return resp
        finally:
            self._leave()

    # -- Abort / WatchEvents -----------------------------------------------------------------
    async def Abort(self, request: pb.AbortRequest, context):
        found = await self.engine.call(lambda e: e.abort(request.request_id))  # on the engine thread
        if not found:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request with id {request.request_id!r} on this worker")
        return pb.AbortResponse(found=True)

    async def WatchEvents(self, request: pb.WatchEventsRequest, context):
        async for msg in self.hub.subscribe():
            yield msg

    # -- LoRA adapters ---------------------------------------------------------------------
    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest, context):
        async with _caller_errors(context):
            adapter = await self.engine.call(lambda e: e.load_lora_adapter(request.lora_name, request.lora_path))
        log.info("loaded LoRA adapter %s from %s (rank %d)", adapter.name, adapter.path, adapter.rank)
        return pb.LoraAdapterInfo(name=adapter.name, digest=adapter.digest, path=adapter.path)

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest, context):
        async with _caller_errors(context):
            await self.engine.call(lambda e: e.unload_lora_adapter(request.lora_name))
        return pb.UnloadLoraAdapterResponse()


async def publish_load(service: WorkerService, interval_s: float) -> None:
    """Every interval: refresh the gauges and send a LoadReport to subscribers."""
    while True:
        load = service.engine.load
        service.metrics.update_load(load)
        service.metrics.update_structured(service.engine.grammar_stats)
        adapters = [pb.LoraAdapterInfo(name=n, digest=d, path=p) for n, d, p in load.lora_adapters]
        service.hub.send_load(
            pb.LoadReport(
                num_waiting=load.num_waiting,
                num_running=load.num_running,
                kv_usage=load.kv_usage,
                queued_prefill_tokens=load.queued_prefill_tokens,
                num_free_blocks=load.num_free_blocks,
                num_cached_blocks=load.num_cached_blocks,
                draining=service.draining,
                adapters=adapters,
                running_lora_adapters=load.running_loras,
                waiting_lora_adapters=load.waiting_loras,
                max_loras=load.max_loras,
                resident_lora_adapters=load.resident_loras,
            )
        )
        await asyncio.sleep(interval_s)


def _read_adapter(engine: AsyncEngine, name: str, path: str):
    """Read an evicted adapter's folder again, in a thread (the read touches no engine state)."""
    faults.adapter_read()
    return engine.read_lora_adapter(name, path)
