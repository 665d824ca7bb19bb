"""Router benchmarks (issue 4, acceptance 7): placement decision time at scale, and the gateway's
overhead over calling a worker directly.

    python bench/router_bench.py [--write docs/benchmarks.md] [--quick]
    python bench/router_bench.py --tracing [--write docs/benchmarks.md]

1. Decision time: 100 simulated workers (50 decode, 50 prefill), 10,000 indexed blocks each,
   fed through the index's KV-event path. Each request is a 1,024-token prompt (64 blocks):
   a third share a 32-block prefix cached on a few workers, a third are cold, a third open with
   a 16-block system prompt every worker holds (the longest index walk). Timed: block hashing
   + index match + filters + scorers + pick + disaggregation decision + speculative inserts,
   i.e. `Dispatcher._place` — tokenization is reported separately. In-memory index, and Redis
   (a local redis-server, one round trip per decision) when redis-server is installed.
2. Gateway overhead: `splitserve router` in its own process in front of (a) a stub worker that
   answers instantly — the difference to calling the stub directly is the gateway's own cost —
   and (b) a real SmolLM2-135M decode worker. The same 64-token prompt (token ids, so no
   tokenization) is sent sequentially, alternating direct gRPC and gateway, so machine noise
   hits both alike; the overhead is the difference of the medians.

3. With --tracing, only the gateway's overhead over the stub worker with request tracing off and
   on at ratio 1.0 (`--otlp-traces-endpoint` to a local OTLP TraceService that discards the
   spans): direct, gateway off and gateway on, alternating. Its section is `router-tracing`.

Results go between the <!-- router:begin --> / <!-- router:end --> markers of the file given
to --write (the section is created if missing, replaced otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time

import grpc
import httpx

from splitserve.platform.hashing import BlockHasher
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc
from splitserve.router.config import RouterConfig
from splitserve.router.placement.index import InMemoryPrefixIndex
from splitserve.router.placement.placer import PlacementRequest, Placer
from splitserve.router.placement.pool import WorkerPool, WorkerState

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import markers, write_section  # noqa: E402

MODEL, BS = "smollm2-135m", 16


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def chain_tokens(rng: random.Random, num_blocks: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(num_blocks * BS)]


def build_fleet(rng, num_workers=100, blocks_per_worker=10_000):
    """Workers with load reports; per worker 10k stored blocks: a shared 16-block system prompt,
    then chains of 64 blocks. Returns (pool, stored hashes per worker, hot prefixes)."""
    hasher = BlockHasher(MODEL, BS)
    pool = WorkerPool(MODEL, BS)
    system = chain_tokens(rng, 16)
    hot = [chain_tokens(rng, 32) for _ in range(50)]
    stored = {}
    for i in range(num_workers):
        address = f"10.0.{i // 250}.{i % 250}:50051"
        role = "decode" if i % 2 == 0 else "prefill"
        pool.workers[address] = WorkerState(
            address,
            role=role,
            is_connected=True,
            load=pb.LoadReport(
                num_waiting=rng.randrange(0, 4),
                num_running=rng.randrange(0, 8),
                kv_usage=rng.random() * 0.8,
                queued_prefill_tokens=rng.randrange(0, 4000),
            ),
        )
        hashes = hasher.hash_blocks(system)
        for j in range(3):  # a few hot prefixes on a few workers each
            hashes += hasher.hash_blocks(hot[(i * 3 + j) % len(hot)])
        while len(hashes) < blocks_per_worker:
            hashes += hasher.hash_blocks(system + chain_tokens(rng, 48))[16:]
        stored[address] = hashes[:blocks_per_worker]
    return pool, stored, system, hot


def requests(rng, system, hot, n):
    out = []
    for k in range(n):
        kind = k % 3
        if kind == 0:
            out.append(hot[rng.randrange(len(hot))] + chain_tokens(rng, 32))
        elif kind == 1:
            out.append(chain_tokens(rng, 64))
        else:
            out.append(system + chain_tokens(rng, 48))
    return out


async def time_decisions(placer, hasher, prompts, warmup=50):
    """Per decision: (wall seconds, this thread's CPU seconds). CPU time leaves out the time the
    process waited for a core, which on a shared 2-core machine dominates the wall-clock tail."""
    times = []
    for i, token_ids in enumerate(prompts):
        t0, c0 = time.perf_counter(), time.thread_time()
        await placer.place(PlacementRequest(len(token_ids), hasher.hash_blocks(token_ids)))
        if i >= warmup:
            times.append((time.perf_counter() - t0, time.thread_time() - c0))
    return times


async def feed(index, stored):
    for address, hashes in stored.items():
        for i in range(0, len(hashes), 500):
            await index.apply(address, pb.KVEvent(stored=pb.BlockStored(block_hashes=hashes[i : i + 500])))


def decision_bench(num_requests: int, with_redis: bool) -> dict:
    rng = random.Random(7)
    pool, stored, system, hot = build_fleet(rng)
    prompts = requests(rng, system, hot, num_requests)
    hasher = BlockHasher(MODEL, BS)
    config = RouterConfig().placement
    results = {}
    index = InMemoryPrefixIndex(ttl_s=0.0)  # no speculative growth across the timed requests
    asyncio.run(feed(index, stored))
    results["memory"] = asyncio.run(time_decisions(Placer(config, pool, index, random.Random(0)), hasher, prompts))
    if with_redis and shutil.which("redis-server"):
        results["redis"] = redis_decisions(config, pool, stored, hasher, prompts[: max(200, num_requests // 4)])
    t0 = time.perf_counter()
    for p in prompts[:200]:
        hasher.hash_blocks(p)
    results["hash_mean_us"] = (time.perf_counter() - t0) / 200 * 1e6
    return results


def redis_decisions(config, pool, stored, hasher, prompts):
    import socket

    from splitserve.router.placement.index_redis import RedisPrefixIndex

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)

        async def run():
            index = RedisPrefixIndex(f"redis://127.0.0.1:{port}/0", "bench", ttl_s=0.0)
            await feed(index, stored)
            times = await time_decisions(Placer(config, pool, index, random.Random(0)), hasher, prompts)
            await index.close()
            return times

        return asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(10)


def tokenize_cost() -> float:
    from splitserve.platform.tokenizer import load_tokenizer

    tok = load_tokenizer(MODEL)
    messages = [{"role": "user", "content": "Summarise the following text. " + "The quick brown fox jumps. " * 150}]
    t0 = time.perf_counter()
    for _ in range(50):
        ids = tok.encode_chat(messages)
    return (time.perf_counter() - t0) / 50 * 1e6, len(ids)


# ---- gateway overhead ---------------------------------------------------------------------------
class StubWorker(pb_grpc.WorkerServicer):
    """A worker that answers instantly (one token per request): isolates the gateway's own cost."""

    async def Generate(self, request, context):
        yield pb.GenerateResponse(
            request_id=request.request_id,
            token_ids=[42],
            text="x",
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=1),
        )

    async def WatchEvents(self, request, context):
        yield pb.WorkerEvent(
            info=pb.WorkerInfo(
                worker_id="stub", role="decode", model_id=MODEL, layout=pb.KVLayout(model_id=MODEL, block_size=BS)
            )
        )
        while True:
            yield pb.WorkerEvent(load=pb.LoadReport())
            await asyncio.sleep(0.5)


async def serve_stub(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(StubWorker(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("READY", flush=True)
    await server.wait_for_termination()


class Proc:
    """A subprocess that prints a line starting with `ready_prefix` when it serves."""

    def __init__(self, argv, ready_prefix):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in self.proc.stdout:
            if line.startswith(ready_prefix):
                break
        else:
            raise RuntimeError(f"{argv[:4]} exited before serving")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway(worker_address: str, extra: tuple[str, ...] = ()) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(
        [
            sys.executable,
            "-m",
            "splitserve.platform.cli",
            "router",
            "--workers",
            worker_address,
            "--port",
            str(port),
            *extra,
        ],
        "splitserve router: serving",
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/ready").status_code != 200:
        assert time.monotonic() < deadline, "the gateway did not see its worker"
        time.sleep(0.1)
    return proc, url


def alternate_off_on(address: str, url_off: str, url_on: str, prompt: list[int], n: int) -> dict[str, list[float]]:
    """n rounds of three one-token requests in turn: the worker directly over gRPC, the gateway
    with a feature off, the gateway with it on (the first 10 rounds warm up and are dropped)."""
    times: dict[str, list[float]] = {"direct": [], "off": [], "on": []}
    channel = grpc.insecure_channel(address)
    stub_client = pb_grpc.WorkerStub(channel)
    params = pb.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    try:
        with httpx.Client(base_url=url_off, timeout=60) as off, httpx.Client(base_url=url_on, timeout=60) as on:
            for i in range(n + 10):
                t0 = time.perf_counter()
                request = pb.GenerateRequest(request_id=f"d-{i}", prompt_token_ids=prompt, params=params)
                list(stub_client.Generate(request))
                t1 = time.perf_counter()
                assert off.post("/v1/completions", json=body).status_code == 200
                t2 = time.perf_counter()
                assert on.post("/v1/completions", json=body).status_code == 200
                t3 = time.perf_counter()
                if i >= 10:
                    times["direct"].append(t1 - t0)
                    times["off"].append(t2 - t1)
                    times["on"].append(t3 - t2)
    finally:
        channel.close()
    return times


def alternate(address: str, url: str, prompt: list[int], max_tokens: int, n: int) -> dict:
    """n sequential requests each way, alternating: direct gRPC, then the gateway."""
    direct, via = [], []
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.WorkerStub(channel)
    params = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=60) as client:
        for i in range(n + 5):
            t0 = time.perf_counter()
            list(stub.Generate(pb.GenerateRequest(request_id=f"direct-{i}", prompt_token_ids=prompt, params=params)))
            t1 = time.perf_counter()
            r = client.post("/v1/completions", json=body)
            t2 = time.perf_counter()
            assert r.status_code == 200, r.text
            if i >= 5:
                direct.append(t1 - t0)
                via.append(t2 - t1)
    channel.close()
    return {"direct": direct, "via": via}


def overhead_bench(n: int) -> dict:
    from splitserve.launch.up import CHILD, WorkerProcess
    from splitserve.platform.settings.worker_args import WorkerArgs

    prompt = [(i * 7919) % 40000 + 100 for i in range(64)]
    results = {}
    stub_port = free_port()
    stub = Proc([sys.executable, __file__, "--serve-stub", str(stub_port)], "READY")
    try:
        gateway, url = start_gateway(f"127.0.0.1:{stub_port}")
        try:
            results["stub"] = alternate(f"127.0.0.1:{stub_port}", url, prompt, 1, n * 4)
        finally:
            gateway.stop()
    finally:
        stub.stop()
    settings = WorkerArgs(
        role="decode", model=MODEL, threads=1, kv_transport="tcp", kv_cache_memory_gib=0.25, max_model_len=2048
    )
    worker = WorkerProcess(settings.replace(**CHILD), "WARNING")
    worker.start()
    try:
        worker.wait_ready(300)
        gateway, url = start_gateway(worker.address)
        try:
            results["smollm2"] = alternate(worker.address, url, prompt, 8, n)
        finally:
            gateway.stop()
    finally:
        worker.stop()
    return results


def tracing_bench(n: int) -> dict[str, list[float]]:
    """Direct, gateway with tracing off, gateway with tracing on (ratio 1.0), alternating, over the stub."""
    from tracing_cost import Sink  # bench/ scripts run from bench/: a sibling module

    sink = Sink()
    prompt = [(i * 7919) % 40000 + 100 for i in range(64)]
    stub_port = free_port()
    address = f"127.0.0.1:{stub_port}"
    stub = Proc([sys.executable, __file__, "--serve-stub", str(stub_port)], "READY")
    gateways = []
    try:
        gateways.append(start_gateway(address))
        gateways.append(
            start_gateway(
                address,
                ("--otlp-traces-endpoint", f"http://127.0.0.1:{sink.port}", "--otlp-traces-sample-ratio", "1.0"),
            )
        )
        times = alternate_off_on(address, gateways[0][1], gateways[1][1], prompt, n)
    finally:
        for proc, _ in gateways:
            proc.stop()  # the traced gateway exports what it buffered
        stub.stop()
        sink.server.stop(0)
    times["num_spans"] = [sink.num_spans]
    return times


def tracing_report(times: dict[str, list[float]]) -> str:
    ms = lambda s: f"{s * 1e3:.3f}"  # noqa: E731
    direct = statistics.median(times["direct"])
    lines = [
        "## Gateway tracing overhead (issue 44)",
        "",
        f"`python bench/router_bench.py --tracing` on this machine ({time.strftime('%Y-%m-%d')}; load average "
        f"{os.getloadavg()[0]:.1f} on 2 shared cores). The same 64-token prompt, one token, against the stub "
        "worker: a direct gRPC Generate, then the gateway with tracing off, then a second gateway with tracing "
        f"on at ratio 1.0, alternating ({len(times['direct'])} each). The traced gateway exported "
        f"{times['num_spans'][0]} spans.",
        "",
        "| path | p50 ms | over direct, p50 ms | p90 ms |",
        "|---|---|---|---|",
    ]
    labels = {"direct": "direct gRPC", "off": "gateway, tracing off", "on": "gateway, tracing on (1.0)"}
    for name, label in labels.items():
        p50 = statistics.median(times[name])
        lines.append(f"| {label} | {ms(p50)} | {ms(p50 - direct)} | {ms(percentile(times[name], 90))} |")
    return "\n".join(lines)


def report(decisions: dict, overhead: dict, tokenize: tuple) -> str:
    ms = lambda s: f"{s * 1e3:.3f}"  # noqa: E731
    lines = [
        "## Router (issue 4)",
        "",
        f"`python bench/router_bench.py --write docs/benchmarks.md` on this machine "
        f"({time.strftime('%Y-%m-%d')}); 2 shared CPU cores, so absolute numbers are noisy.",
        "",
        "**Decision time per request**: 100 simulated workers (50 decode, 50 prefill), 10,000 indexed "
        "blocks each (1,000,000 entries), 1,024-token prompts (64 blocks); block hashing + index match + "
        "filters + 4 scorers + pick + disaggregation decision + prefill pick. Target: p99 < 2 ms.",
        "",
        "Wall-clock times include waiting for a core on this shared machine (its load average was "
        f"{os.getloadavg()[0]:.1f} on 2 cores); CPU times are the router thread's own work.",
        "",
        "| index | requests | clock | p50 ms | p90 ms | p99 ms | max ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("memory", "redis"):
        if name not in decisions:
            continue
        for column, clock in ((0, "wall"), (1, "CPU")):
            t = [pair[column] for pair in decisions[name]]
            lines.append(
                f"| {'in-memory' if name == 'memory' else 'Redis (loopback)'} | {len(t)} | {clock} | "
                f"{ms(statistics.median(t))} | {ms(percentile(t, 90))} | {ms(percentile(t, 99))} | "
                f"{ms(max(t))} |"
            )
    lines += [
        "",
        f"Of which hashing the 64 blocks: {decisions['hash_mean_us']:.0f} µs. Tokenizing a "
        f"{tokenize[1]}-token chat prompt (done once per request, before placement): {tokenize[0]:.0f} µs.",
        "",
    ]
    lines += [
        "**Gateway overhead**: the same 64-token prompt (as token ids, so no tokenization) sent "
        "sequentially, alternating between a direct gRPC Generate and the gateway's /v1/completions "
        "(`splitserve router` in its own process). Against a stub worker that answers instantly, the "
        "difference is the gateway's own cost; against the real SmolLM2-135M worker it is its share "
        "of a request.",
        "",
        "| worker | tokens | requests | direct p50 ms | gateway p50 ms | overhead p50 ms | direct p90 ms | "
        "gateway p90 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, tokens in (("stub", 1), ("smollm2", 8)):
        d, v = overhead[name]["direct"], overhead[name]["via"]
        md, mv = statistics.median(d), statistics.median(v)
        label = "stub (instant)" if name == "stub" else "SmolLM2-135M decode worker"
        lines.append(
            f"| {label} | {tokens} | {len(d)} | {ms(md)} | {ms(mv)} | {ms(mv - md)} "
            f"({(mv - md) / md * 100:.0f} %) | {ms(percentile(d, 90))} | {ms(percentile(v, 90))} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", default=None, help="markdown file to put the results in")
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--tracing", action="store_true", help="only the gateway's overhead with tracing off and on")
    parser.add_argument("--serve-stub", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_stub:
        asyncio.run(serve_stub(args.serve_stub))
        return 0
    if args.tracing:
        text = tracing_report(tracing_bench(40 if args.quick else 200))
        print(text)
        if args.write:
            begin, end = markers("router-tracing")
            write_section(args.write, "router-tracing", f"{begin}\n{text}\n{end}")
        return 0
    decisions = decision_bench(300 if args.quick else 3000, with_redis=True)
    tokenize = tokenize_cost()
    overhead = overhead_bench(10 if args.quick else 50)
    text = report(decisions, overhead, tokenize)
    print(text)
    if args.write:
        begin, end = markers("router")
        write_section(args.write, "router", f"{begin}\n{text}\n{end}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
