"""Test kit for the router: an event loop in a thread, a router + gateway served on a free port,
a fake worker that speaks the real Worker gRPC protocol, and a throwaway redis-server.

The fake worker answers Generate with a deterministic continuation: output token i of a
request depends only on the position (prompt length + i), so resuming from prompt + tokens
already sent yields exactly the undisturbed answer, as greedy decoding does on a real worker.
Asked for prompt_logprobs or embed, it answers them on its first message (-1 per prompt token;
[1, 0, 0]). It publishes real KV events (BlockStored of the prompt's full blocks, hashed with
platform.hashing) and load reports, records every request, its gRPC metadata and every
cancellation, and can be told to fail, to crash after N tokens, or to stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import subprocess
import threading
import time
import uuid

import grpc
import redis
from ports import free_port

from splitserve.platform.hashing import BlockHasher
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc
from splitserve.router.config import RouterConfig
from splitserve.router.main import bind, uvicorn_server


class LoopThread:
    """An asyncio loop in a daemon thread; `run(coro)` runs a coroutine there and returns its result."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args):
        async def wrapper():
            return fn(*args)

        return self.run(wrapper())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class RouterServer:
    """A Router and its gateway (uvicorn) on 127.0.0.1:<free port>, inside a LoopThread."""

    def __init__(self, loop: LoopThread, config: RouterConfig, tokenizer=None, index=None, discovery=None, rng=None):
        self.loop = loop
        self.config = config
        self.kwargs = dict(tokenizer=tokenizer, index=index, discovery=discovery, rng=rng)
        self.router = None
        self.server = None
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def start(self, num_decode: int = 1, num_prefill: int = 0, timeout: float = 60) -> RouterServer:
        self.loop.run(self._start(num_decode, num_prefill, timeout), timeout + 30)
        return self

    async def _start(self, num_decode, num_prefill, timeout):
        from splitserve.router.api.app import create_app
        from splitserve.router.router import Router

        self.router = Router(self.config, **self.kwargs)
        self.server = uvicorn_server(create_app(self.router))
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            await asyncio.sleep(0.02)
        if num_decode or num_prefill:
            await self.router.wait_ready(timeout, num_decode, num_prefill)

    def stop(self) -> None:
        async def _stop():
            self.server.should_exit = True
            await asyncio.wait_for(self.task, 30)

        self.loop.run(_stop(), 60)


def router_config(workers=(), tls=None, stale_after_s: float = 2.0, **sections) -> RouterConfig:
    """RouterConfig with static workers; `tls` (platform.wire.grpc_tls.TlsFiles, e.g. workerproc's
    `security().tls`) for mTLS to real workers; a worker silent for `stale_after_s` is marked
    down (2 s suits FakeWorkers; in front of worker processes use workerproc.ROUTER_STALE_AFTER_S);
    `sections` replace fields, e.g. gateway=GatewayConfig(...)."""
    config = RouterConfig()
    secure = (
        {} if tls is None else dict(tls_cert=tls.cert, tls_key=tls.key, tls_ca=tls.ca, tls_server_name=tls.server_name)
    )
    discovery = dataclasses.replace(
        config.discovery,
        workers=tuple(workers),
        backoff_initial_s=0.1,
        backoff_max_s=0.5,
        stale_after_s=stale_after_s,
        **secure,
    )
    return dataclasses.replace(config, discovery=discovery, **sections)


# ---------------------------------------------------------------------------------------------
class FakeWorker(pb_grpc.WorkerServicer):
    """A Worker gRPC server in the test's LoopThread (see the module docstring)."""

    def __init__(
        self,
        role: str = "decode",
        tokenizer=None,
        model_id: str = "smollm2-135m",
        block_size: int = 16,
        token_delay_s: float = 0.0,
        port: int | None = None,
    ):
        self.role = role
        self.tokenizer = tokenizer
        self.model_id, self.block_size = model_id, block_size
        self.hasher = BlockHasher(model_id, block_size)
        self.token_delay_s = token_delay_s
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict] = []
        self.cancelled: list[str] = []
        self.fail_next: list[grpc.StatusCode] = []  # codes for the next Generate calls, before any token
        self.crash_after_tokens: int | None = None  # stop the server abruptly after this many tokens
        self.stall_after_tokens: int | None = None  # go silent (no tokens, no events), as if SIGSTOPped
        self.is_stalled = False
        self.load = pb.LoadReport()
        self.cached: dict[bytes, None] = {}
        self.server = None
        self.worker_id = ""
        self._queues: set[asyncio.Queue] = set()

    async def start(self) -> FakeWorker:
        self.worker_id = uuid.uuid4().hex
        self.server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(self, self.server)
        self.server.add_insecure_port(self.address)
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None

    @staticmethod
    def token_at(position: int) -> int:
        return 200 + (position * 37) % 700

    async def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if self.role == "prefill":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Generate is not served by a prefill worker")
        if self.fail_next:
            await context.abort(self.fail_next.pop(0), "injected failure")
        if request.params.HasField("temperature") and request.params.temperature < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature=-1 is invalid")
        # A resume continues after the tokens already sent, as the real worker does.
        prompt = list(request.prompt_token_ids) + list(request.resume_output_token_ids)
        hashes = self.hasher.hash_blocks(prompt)
        cached = next((i for i, h in enumerate(hashes) if h not in self.cached), len(hashes)) * self.block_size
        # a pull the router asked for lands the holder's blocks, as the real worker's does
        pulled = max(request.kv_pull.num_blocks * self.block_size - cached, 0) if request.HasField("kv_pull") else 0
        self._publish(pb.KVEvent(stored=pb.BlockStored(block_hashes=hashes)), hashes)
        try:
            async for msg in self._stream(request, prompt, cached, pulled):
                yield msg
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    async def _stream(self, request, prompt, cached, pulled=0):
        max_tokens = request.params.max_tokens if request.params.HasField("max_tokens") else 16
        max_tokens -= len(request.resume_output_token_ids)
        out: list[int] = []
        text = ""
        for i in range(max_tokens):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if self.crash_after_tokens is not None and len(out) >= self.crash_after_tokens:
                self.crash_after_tokens = None
                asyncio.get_running_loop().create_task(self.stop())
                await asyncio.sleep(10)
            if self.stall_after_tokens is not None and len(out) >= self.stall_after_tokens:
                self.stall_after_tokens, self.is_stalled = None, True
            while self.is_stalled:
                await asyncio.sleep(0.05)
            out.append(self.token_at(len(prompt) + i))
            full = self.tokenizer.decode(out) if self.tokenizer else "".join(f" w{t}" for t in out)
            delta, text = full[len(text) :], full
            finish = pb.FINISH_REASON_LENGTH if i == max_tokens - 1 else pb.FINISH_REASON_UNSPECIFIED
            lps = (
                [pb.TokenLogprob(token_id=out[-1], logprob=-0.5, top=[pb.TopLogprob(token_id=out[-1], logprob=-0.5)])]
                if request.params.HasField("logprobs")
                else []
            )
            first = i == 0  # the prompt's scores and embedding come on the first message, as a worker's do
            prompt_lps = (
                [pb.TokenLogprob(token_id=t, logprob=-1.0) for t in prompt[1:]]
                if first and request.params.HasField("prompt_logprobs")
                else []
            )
            embedding = [1.0, 0.0, 0.0] if first and request.params.embed else []
            yield pb.GenerateResponse(
                request_id=request.request_id,
                token_ids=[out[-1]],
                text=delta,
                logprobs=lps,
                finish_reason=finish,
                usage=pb.Usage(
                    prompt_tokens=len(prompt), completion_tokens=len(out), cached_tokens=cached, pulled_tokens=pulled
                ),
                prefill_worker=request.prefill_workers[0] if request.prefill_workers else "",
                prompt_logprobs=prompt_lps,
                embedding=embedding,
            )

    async def Abort(self, request, context):
        return pb.AbortResponse(found=False)

    async def LoadLoraAdapter(self, request, context):
        """As the real worker: a folder with adapter_config.json loads (digest: of the config's
        bytes here), a path that is no folder is NOT_FOUND, anything else INVALID_ARGUMENT; the
        adapter shows in the load reports."""
        import hashlib
        import os

        config = os.path.join(request.lora_path, "adapter_config.json")
        if not os.path.isdir(request.lora_path):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{request.lora_path!r} is not a folder")
        if not request.lora_name or not os.path.isfile(config):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{request.lora_path}: cannot read adapter_config.json"
            )
        with open(config, "rb") as f:
            digest = hashlib.sha256(f.read()).digest()
        info = pb.LoraAdapterInfo(name=request.lora_name, digest=digest, path=request.lora_path)
        self._set_adapters([a for a in self.load.adapters if a.name != request.lora_name] + [info])
        return info

    async def UnloadLoraAdapter(self, request, context):
        if request.lora_name not in {a.name for a in self.load.adapters}:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"adapter {request.lora_name!r} is not loaded")
        self._set_adapters([a for a in self.load.adapters if a.name != request.lora_name])
        return pb.UnloadLoraAdapterResponse()

    def _set_adapters(self, adapters) -> None:
        load = pb.LoadReport()
        load.CopyFrom(self.load)
        del load.adapters[:]
        load.adapters.extend(adapters)
        self.load = load

    async def WatchEvents(self, request, context):
        queue: asyncio.Queue = asyncio.Queue()
        self._queues.add(queue)
        try:
            yield pb.WorkerEvent(
                info=pb.WorkerInfo(
                    worker_id=self.worker_id,
                    role=self.role,
                    model_id=self.model_id,
                    layout=pb.KVLayout(model_id=self.model_id, block_size=self.block_size),
                )
            )
            yield pb.WorkerEvent(kv=pb.KVEvent(cleared=pb.AllCleared()))
            if self.cached:
                yield pb.WorkerEvent(kv=pb.KVEvent(stored=pb.BlockStored(block_hashes=list(self.cached))))
            yield pb.WorkerEvent(load=self.load)  # as the real hub: the latest report with the snapshot
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), 0.1)
                except TimeoutError:
                    event = pb.WorkerEvent(load=self.load)
                while self.is_stalled:
                    await asyncio.sleep(0.05)
                yield event
        finally:
            self._queues.discard(queue)

    def _publish(self, event: pb.KVEvent, hashes) -> None:
        self.cached.update(dict.fromkeys(hashes))
        for queue in self._queues:
            queue.put_nowait(pb.WorkerEvent(kv=event))


# ---------------------------------------------------------------------------------------------
class RedisServer:
    """redis-server on a free loopback port, no persistence; `stop()` ends it."""

    def __init__(self):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: apt-get install -y redis-server")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(redis.exceptions.ConnectionError):
                if client.ping():
                    break
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        client.close()

    def flush(self) -> None:
        client = redis.Redis(port=self.port)
        client.flushall()
        client.close()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
