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
from splitserve.platform.sampling.params import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._ids = itertools.count()
        self.load = engine.load()       # refreshed by the engine thread after every step
        # Called on the engine thread with each batch of KV events; must not block.
        self.on_kv_events: Callable[[list], None] | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine(config))

    async def generate(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                       prompt_token_ids: Sequence[int] | None = None, req_id: str | None = None,
                       **options) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises InvalidRequestError before the first output.

        `options` go to LLMEngine.add_request (remote_prefill, kv_export, resume_output_token_ids).
        """
        req_id = req_id or f"async-{next(self._ids)}"
        if params is not None and params.structured is not None:  # compile off the engine thread (cached)
            await asyncio.to_thread(self.engine.grammars.compile, params.structured)
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

    def fallback_to_local_prefill(self, req_id: str) -> None:
        self._command("fallback", req_id)

    async def call(self, fn: Callable[[LLMEngine], object]):
        """Run fn(engine) on the engine thread between steps and return its result."""
        future = asyncio.get_running_loop().create_future()
        self._command("call", fn, future)
        return await future

    def _command(self, *cmd) -> None:
        self._commands.put(cmd)
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    # -- engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped:
            self._apply_commands()
            self._publish()
            if not self.engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # a bug in a step must not hang every client: fail them all
                log.exception("engine step failed; aborting all requests")
                outputs = [self.engine.outputs.finish_aborted(r) for r in self._abort_all()]
            for out in outputs:
                self._deliver(out)

    def _publish(self) -> None:
        self.load = self.engine.load()
        events = self.engine.take_kv_events()
        if events and self.on_kv_events is not None:
            self.on_kv_events(events)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "abort":
                self.engine.abort(cmd[1])
            elif cmd[0] == "complete":
                out = self.engine.complete_remote_prefill(*cmd[1:])
                if out is not None:
                    self._deliver(out)
            elif cmd[0] == "fallback":
                self.engine.fallback_to_local_prefill(cmd[1])
            elif cmd[0] == "call":
                self._call(*cmd[1:])
            else:
                self._add(*cmd[1:])

    def _call(self, fn, future) -> None:
        loop = future.get_loop()
        try:
            value = fn(self.engine)
        except Exception as exc:  # handed back to the caller (bound now: `exc` is unset after the block)
            loop.call_soon_threadsafe(lambda error=exc: future.done() or future.set_exception(error))
            return
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(value))

    def _add(self, req_id, prompt, params, token_ids, options, done) -> None:
        try:
            self.engine.add_request(prompt, params, prompt_token_ids=token_ids, req_id=req_id, **options)
            error = None
        except Exception as exc:  # validation errors go back to the caller
            error = exc
        self._resolve(req_id, done, error)

    def _resolve(self, req_id, done, error) -> None:
        entry = self._streams.get(req_id)
        if entry is None:
            if error is None:
                self.engine.abort(req_id)
            return
        loop = entry[0]
        loop.call_soon_threadsafe(lambda: done.done() or (done.set_exception(error) if error else done.set_result(None)))

    def _abort_all(self):
        reqs = list(self.engine.scheduler.requests.values())
        for req in reqs:
            self.engine.scheduler.finish_request(req.req_id, req.status.FINISHED_ABORTED)
        return reqs

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._streams.get(out.req_id)
        if entry is not None:
            entry[0].call_soon_threadsafe(entry[1].put_nowait, out)
