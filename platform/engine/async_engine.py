"""An asyncio front for the engine: `async for out in engine.generate(...)` streams outputs.

The engine is driven by one background thread (torch releases the GIL inside ops, so the
event loop stays responsive). Requests and aborts from the event loop are queued and applied
by that thread between steps, so the engine keeps a single writer. Outputs are handed back to
each request's asyncio.Queue with call_soon_threadsafe. Cancelling the consumer of
`generate()` (a client that disconnects) aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence

from splitserve.platform.config import EngineConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.engine.outputs import RequestOutput
from splitserve.platform.errors import TensorParallelError
from splitserve.platform.sampling.params import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_kv_events: Callable[[list], None] | None = None):
        self._engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._ids = itertools.count()
        # What other threads may read, never engine internals (the engine thread is the single
        # writer): the immutable load snapshot, refreshed after every step, and the values below.
        self.load = engine.load()
        # Called on the engine thread with each batch of KV events; must not block.
        self.on_kv_events = on_kv_events
        # Called once on the engine thread when the engine can never step again (a rank of its
        # tensor-parallel group failed: TensorParallelError); a worker exits non-zero from it.
        self.on_fatal: Callable[[Exception], None] | None = None
        self.fatal: Exception | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # -- what the event loop may read or call directly -------------------------------------------
    @property
    def model_config(self):
        return self._engine.model_config  # fixed at load

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len  # fixed at load

    @property
    def grammar_stats(self):
        """The grammar backend's compile counters (monotonic, read without a lock), or None."""
        return self._engine.grammar_stats

    def kv_layer_skip(self, num_prompt_tokens: int, start_block: int) -> tuple[int, ...]:
        """Per layer, the prompt blocks P/D does not move (KVConnector.layer_skip; any thread)."""
        return self._engine.kv_connector.layer_skip(num_prompt_tokens, start_block)

    def write_kv_layer(self, block_ids, layer: int, payload) -> None:
        """Copy a received KV layer into a request's blocks (safe off the engine thread: see
        KVConnector.write_layer)."""
        self._engine.write_kv_layer(block_ids, layer, payload)

    def read_lora_adapter(self, name: str, path: str):
        """Read an adapter's folder (in a worker thread: the registry's read touches no state)."""
        return self._engine.loras.read(name, path)

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    async def generate(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        req_id: str | None = None,
        **options,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises InvalidRequestError before the first output.

        `options` go to LLMEngine.add_request (remote_prefill, kv_export, resume_output_token_ids).
        """
        req_id = req_id or f"async-{next(self._ids)}"
        if params is not None and params.structured is not None:  # compile off the engine thread (cached)
            await asyncio.to_thread(self._engine.inputs.grammars.compile, params.structured)
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        done = loop.create_future()
        self._streams[req_id] = (loop, stream)
        self._commands.put(("add", req_id, prompt, params, prompt_token_ids, options, done))
        self._wake.set()
        finished = False
        try:
            await done  # re-raises the validation error, if any
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(req_id, None)
            if not finished:
                self.abort(req_id)

    def abort(self, req_id: str) -> None:
        self._command("abort", req_id)

    def complete_remote_prefill(self, req_id: str, first_token_id: int, logprob=None) -> None:
        """The KV landed: the request starts decoding (its outputs arrive on its stream)."""
        self._command("complete", req_id, first_token_id, logprob)

    def fallback_to_local_prefill(self, req_id: str, num_computed_tokens: int | None = None) -> None:
        self._command("fallback", req_id, num_computed_tokens)

    def hold_blocks(self, block_ids) -> None:
        """KVConnector.hold_blocks, applied between steps in order with the other commands: a hold
        issued before a request's abort takes its reference while the request still has them."""
        self._command("hold", tuple(block_ids))

    def release_blocks(self, block_ids) -> None:
        self._command("release", tuple(block_ids))

    async def call(self, fn: Callable[[LLMEngine], object]):
        """Run fn(engine) on the engine thread between steps and return its result."""
        future = asyncio.get_running_loop().create_future()
        self._command("call", fn, future)
        return await future

    def _command(self, *cmd) -> None:
        self._commands.put(cmd)
        self._wake.set()

    def shutdown(self) -> None:
        """Stop the engine thread, then end the engine's other ranks (tensor parallelism)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._engine.close()

    # -- engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped:
            self._apply_commands()
            self._publish()
            if not self._engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self._engine.step()
            except Exception as exc:  # a bug in a step must not hang every client: fail them all
                log.exception("engine step failed; aborting all requests")
                outputs = self._engine.abort_all()
                if isinstance(exc, TensorParallelError) and self.fatal is None:
                    self.fatal = exc
                    if self.on_fatal is not None:
                        self.on_fatal(exc)
            for out in outputs:
                self._deliver(out)

    def _publish(self) -> None:
        self.load = self._engine.load()
        events = self._engine.take_kv_events()
        if events and self.on_kv_events is not None:
            self.on_kv_events(events)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "abort":
                self._engine.abort(cmd[1])
            elif cmd[0] == "complete":
                out = self._engine.complete_remote_prefill(*cmd[1:])
                if out is not None:
                    self._deliver(out)
            elif cmd[0] == "fallback":
                self._engine.fallback_to_local_prefill(*cmd[1:])
            elif cmd[0] == "hold":
                self._engine.kv_connector.hold_blocks(cmd[1])
            elif cmd[0] == "release":
                self._engine.kv_connector.release_blocks(cmd[1])
            elif cmd[0] == "call":
                self._call(*cmd[1:])
            else:
                self._add(*cmd[1:])

    def _call(self, fn, future) -> None:
        loop = future.get_loop()
        try:
            value = fn(self._engine)
        except Exception as exc:  # handed back to the caller (bound now: `exc` is unset after the block)
            loop.call_soon_threadsafe(lambda error=exc: future.done() or future.set_exception(error))
            return
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(value))

    def _add(self, req_id, prompt, params, token_ids, options, done) -> None:
        try:
            self._engine.add_request(prompt, params, prompt_token_ids=token_ids, req_id=req_id, **options)
            error = None
        except Exception as exc:  # validation errors go back to the caller
            error = exc
        self._resolve(req_id, done, error)

    def _resolve(self, req_id, done, error) -> None:
        entry = self._streams.get(req_id)
        if entry is None:
            if error is None:
                self._engine.abort(req_id)
            return
        loop = entry[0]

        def settle():
            if not done.done():
                done.set_exception(error) if error else done.set_result(None)

        loop.call_soon_threadsafe(settle)

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._streams.get(out.req_id)
        if entry is not None:
            entry[0].call_soon_threadsafe(entry[1].put_nowait, out)
