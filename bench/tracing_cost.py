"""What request tracing costs (platform/observability/tracing.py): off, and on at ratio 1.0.

    python bench/tracing_cost.py [--requests 60] [--write docs/benchmarks.md]

1. The span calls of one disaggregated request on a decode and a prefill worker (a server span,
   its 10 children with attributes, one context injection, export through the batching
   OTLP exporter to a local TraceService that discards them), in this process: microseconds per
   request with tracing off (every span is the no-op) and on.
2. End to end on real workers: two SmolLM2-135M decode workers, one started with
   `--otlp-traces-endpoint` (exporting to a local TraceService), one without. The same 64-token
   prompt goes to each in turn, sequentially, with a sampled `traceparent`, so machine noise hits
   both alike; the cost is the difference of the medians.

Results go between the <!-- tracing:begin --> / <!-- tracing:end --> markers of --write's file.
The gateway's own cost with tracing off and on: `bench/router_bench.py --tracing`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tsvc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tsvc_grpc

from splitserve.platform.observability import tracing
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import markers, write_section  # noqa: E402

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Sink(tsvc_grpc.TraceServiceServicer):
    """An OTLP TraceService that counts and discards what it receives."""

    def __init__(self):
        self.num_spans = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        tsvc_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        self.num_spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        return tsvc.ExportTraceServiceResponse()


def one_request(tracer: tracing.Tracer) -> None:
    """The spans a disaggregated request makes on its two workers."""
    t = time.monotonic()
    root = tracer.start(
        "worker.generate",
        {"traceparent": TRACEPARENT},
        attributes={"gen_ai.request.model": "smollm2-135m", "gen_ai.usage.input_tokens": 64},
    )
    root.record("worker.queue", t, t)
    with root.child("worker.remote_prefill") as wait, wait.child("prefill.call", kind="client") as call:
        carrier: dict = {}
        call.inject(carrier)
        with call.child("kv.receive", attributes={"splitserve.kv.num_blocks": 4}) as receive:
            receive.set("splitserve.kv.num_bytes", 1 << 20)
        prefill = tracer.start("prefill.request", carrier)
        prefill.record("prefill.queue", t, t)
        prefill.record("prefill.compute", t, t)
        with prefill.child("kv.send") as send:
            send.set("splitserve.kv.num_bytes", 1 << 20)
        prefill.end()
    root.record("worker.first_token", t, t)
    root.update({"gen_ai.usage.output_tokens": 8, "gen_ai.response.finish_reasons": ["length"]})
    root.end()


def span_cost(sink: Sink, n: int) -> dict[str, float]:
    out = {}
    for name, tracer in (
        ("off", tracing.Tracer()),
        ("on", tracing.OtelTracer(tracing.TracingConfig(role="decode", endpoint=f"http://127.0.0.1:{sink.port}"))),
    ):
        for _ in range(20):
            one_request(tracer)
        t0 = time.perf_counter()
        for _ in range(n):
            one_request(tracer)
        out[name] = (time.perf_counter() - t0) / n * 1e6
        tracer.shutdown()
    return out


def end_to_end(sink: Sink, n: int) -> dict[str, list[float]]:
    from splitserve.launch.up import CHILD, WorkerProcess
    from splitserve.platform.settings.worker_args import WorkerArgs

    settings = WorkerArgs(
        role="decode", model="smollm2-135m", threads=1, kv_transport="tcp", kv_cache_memory_gib=0.25, max_model_len=2048
    ).replace(**CHILD)
    workers = {
        "off": WorkerProcess(settings, "WARNING"),
        "on": WorkerProcess(settings, "WARNING", ("--otlp-traces-endpoint", f"http://127.0.0.1:{sink.port}")),
    }
    for w in workers.values():
        w.start()
    try:
        for w in workers.values():
            w.wait_ready(300)
        return asyncio.run(_alternate({k: w.address for k, w in workers.items()}, n))
    finally:
        for w in workers.values():
            w.stop()


async def _alternate(addresses: dict[str, str], n: int) -> dict[str, list[float]]:
    prompt = [(i * 7919) % 40000 + 100 for i in range(64)]
    params = pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    times: dict[str, list[float]] = {k: [] for k in addresses}
    channels = {k: grpc.aio.insecure_channel(a) for k, a in addresses.items()}
    try:
        for i in range(n + 5):
            for name, channel in channels.items():
                stub = pb_grpc.WorkerStub(channel)
                t0 = time.perf_counter()
                async for _ in stub.Generate(
                    pb.GenerateRequest(request_id=f"{name}-{i}", prompt_token_ids=prompt, params=params),
                    metadata=(("traceparent", TRACEPARENT),),
                ):
                    pass
                if i >= 5:
                    times[name].append(time.perf_counter() - t0)
    finally:
        for channel in channels.values():
            await channel.close()
    return times


def report(spans: dict[str, float], e2e: dict[str, list[float]], num_exported: int) -> str:
    off, on = statistics.median(e2e["off"]), statistics.median(e2e["on"])
    return "\n".join(
        [
            "## Request tracing (issue 44)",
            "",
            f"`python bench/tracing_cost.py` on this machine ({time.strftime('%Y-%m-%d')}; load average "
            f"{os.getloadavg()[0]:.1f} on 2 shared cores: end-to-end numbers are noisy).",
            "",
            "| what | tracing off | on, ratio 1.0 | cost |",
            "|---|---|---|---|",
            f"| span calls of one disaggregated request (11 spans, both workers), µs | {spans['off']:.1f} | "
            f"{spans['on']:.1f} | {spans['on'] - spans['off']:.1f} µs |",
            f"| SmolLM2-135M decode worker, 64-token prompt, 8 tokens, p50 ms ({len(e2e['off'])} each) | "
            f"{off * 1e3:.2f} | {on * 1e3:.2f} | {(on - off) * 1e3:+.2f} ms ({(on - off) / off * 100:+.1f} %) |",
            "",
            f"The traced worker exported {num_exported} spans to a local OTLP TraceService.",
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60, help="requests to each worker (after 5 warm-up)")
    parser.add_argument("--write", default=None, help="markdown file to put the results in")
    args = parser.parse_args(argv)
    sink = Sink()
    spans = span_cost(sink, 150)  # 1,650 spans: within the batch processor's queue (2,048), none dropped
    print(f"span calls per request: off {spans['off']:.1f} µs, on {spans['on']:.1f} µs", flush=True)
    before = sink.num_spans
    e2e = end_to_end(sink, args.requests)
    text = report(spans, e2e, sink.num_spans - before)
    print(text)
    if args.write:
        begin, end = markers("tracing")
        write_section(args.write, "tracing", f"{begin}\n{text}\n{end}")
    sink.server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
