"""Worker traces, timings and log correlation, on real `splitserve worker` processes.

A decode and a prefill worker (KV over tcp) export spans to an OTLP gRPC TraceService receiver
started here (tests/otlp_receiver.py); the test calls Generate with a client `traceparent` in
the gRPC metadata, as the gateway does.
"""

import asyncio
import json
import subprocess

import pytest
from otlp_receiver import OtlpReceiver
from workerproc import CLI, WorkerProc, free_port

from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
BYTES_PER_BLOCK_LAYER = 2 * 16 * 3 * 64 * 2  # SmolLM2, float16 KV (the workers' auto)
NUM_LAYERS = 30
DECODE_SPANS = {
    "worker.generate",
    "worker.queue",
    "worker.remote_prefill",
    "prefill.call",
    "kv.receive",
    "worker.first_token",
}
PREFILL_SPANS = {"prefill.request", "prefill.queue", "prefill.compute", "kv.send"}


def traceparent(trace_id: str) -> str:
    return f"00-{trace_id}-{PARENT}-01"


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 40000 + 100 for i in range(n)]


@pytest.fixture(scope="module")
def stack():
    with OtlpReceiver() as receiver:
        tracing_args = ("--otlp-traces-endpoint", receiver.endpoint)
        env = {"OTEL_BSP_SCHEDULE_DELAY": "200", "SPLITSERVE_LOG_FORMAT": "json"}
        d = WorkerProc("decode", "tcp", *tracing_args, env=env).start()
        p = WorkerProc("prefill", "tcp", *tracing_args, env=env).start()
        yield receiver, d, p
        for w in (d, p):
            w.terminate()


def generate(worker: WorkerProc, token_ids, trace_id: str, prefill_workers=(), mode=pb.DISAGGREGATION_MODE_ALWAYS):
    async def call():
        async with worker.channel() as channel:
            request = pb.GenerateRequest(
                request_id=f"req-{trace_id[:8]}",
                prompt_token_ids=token_ids,
                params=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                prefill_workers=list(prefill_workers),
                disaggregation=mode,
            )
            return [
                m
                async for m in pb_grpc.WorkerStub(channel).Generate(
                    request, metadata=(("traceparent", traceparent(trace_id)),)
                )
            ]

    return asyncio.run(call())


def test_one_trace_spans_decode_prefill_and_both_kv_ends(stack):
    receiver, d, p = stack
    msgs = generate(d, prompt(300, salt=1), TRACE, [p.address])
    assert msgs[-1].prefill_worker == p.address
    spans = receiver.wait_for(TRACE, DECODE_SPANS | PREFILL_SPANS)
    by_name = {s.name: s for s in spans}
    assert set(by_name) == DECODE_SPANS | PREFILL_SPANS
    assert {s.trace_id for s in spans} == {TRACE}
    parent = {name: by_name[name].parent_id for name in by_name}
    ids = {name: by_name[name].span_id for name in by_name}
    assert parent["worker.generate"] == PARENT  # the client's span
    for child in ("worker.queue", "worker.remote_prefill", "worker.first_token"):
        assert parent[child] == ids["worker.generate"]
    assert parent["prefill.call"] == ids["worker.remote_prefill"]
    assert parent["kv.receive"] == parent["prefill.request"] == ids["prefill.call"]  # across the gRPC call
    for child in ("prefill.queue", "prefill.compute", "kv.send"):
        assert parent[child] == ids["prefill.request"]
    assert {by_name[n].service for n in DECODE_SPANS} == {"splitserve-decode"}
    assert {by_name[n].service for n in PREFILL_SPANS} == {"splitserve-prefill"}
    send, receive = by_name["kv.send"].attributes, by_name["kv.receive"].attributes
    expected_bytes = -(-300 // 16) * NUM_LAYERS * BYTES_PER_BLOCK_LAYER
    assert send["splitserve.kv.transfer_id"] == receive["splitserve.kv.transfer_id"]
    assert send["splitserve.kv.transfer_id"] == by_name["prefill.request"].attributes["splitserve.kv.transfer_id"]
    assert send["splitserve.kv.num_bytes"] == receive["splitserve.kv.num_bytes"] == expected_bytes
    assert send["splitserve.kv.num_blocks"] == receive["splitserve.kv.num_blocks"] == 19
    assert send["splitserve.kv.path"] == receive["splitserve.kv.path"] == "tcp"
    gen = by_name["worker.generate"].attributes
    assert gen["gen_ai.usage.input_tokens"] == 300 and gen["gen_ai.usage.output_tokens"] == 4
    assert gen["gen_ai.response.finish_reasons"] == ["length"] and gen["gen_ai.request.model"]
    assert "gen_ai.prompt.token_ids" not in gen  # no prompt unless a flag asks
    # The spans tell the worker's TTFT: generate start -> first token end, and the three phases add up.
    ttft = msgs[0].timings.first_token_s
    assert by_name["worker.first_token"].end_s - by_name["worker.generate"].start_s == pytest.approx(ttft, rel=0.1)
    phases = sum(by_name[n].duration_s for n in ("worker.queue", "worker.remote_prefill", "worker.first_token"))
    assert phases == pytest.approx(ttft, rel=0.1)
    assert by_name["prefill.compute"].duration_s == pytest.approx(msgs[0].timings.prefill_s, rel=0.1, abs=0.002)


def test_splitserve_trace_shows_the_breakdown(stack, tmp_path):
    receiver, d, p = stack
    trace_id = "3" * 32
    msgs = generate(d, prompt(300, salt=4), trace_id, [p.address])
    req_id = f"req-{trace_id[:8]}"
    receiver.wait_for(trace_id, DECODE_SPANS | PREFILL_SPANS)
    done = subprocess.run(
        [CLI, "trace", req_id, "--worker", f"127.0.0.1:{d.metrics_port}", "--worker", f"127.0.0.1:{p.metrics_port}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"request {req_id} on the decode worker" in out and f"(trace {trace_id})" in out
    assert f"remote, on {p.address}; 300 prompt tokens" in out
    ttft_ms = float(out.split("TTFT")[1].split("ms")[0])
    assert ttft_ms == pytest.approx(msgs[0].timings.first_token_s * 1000, abs=0.1)
    assert f"request {req_id} on the prefill worker" in out and "prefill compute" in out
    assert f"{-(-300 // 16) * NUM_LAYERS * BYTES_PER_BLOCK_LAYER} bytes" in out
    header, depth = receiver.shown_tree(CLI, req_id, tmp_path)
    assert header.startswith(f"trace {trace_id}: {len(DECODE_SPANS | PREFILL_SPANS)} spans")
    assert depth["worker.generate"] < depth["worker.remote_prefill"] < depth["prefill.call"] < depth["kv.send"]
    assert depth["kv.receive"] == depth["prefill.request"] == depth["prefill.call"] + 2
    missing = subprocess.run(
        [CLI, "trace", "no-such-request", "--worker", f"127.0.0.1:{d.metrics_port}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "no record or span" in missing.stderr


def test_colocated_request_reports_real_queue_and_prefill_timings(stack):
    receiver, d, _ = stack
    trace_id = "1" * 32
    msgs = generate(d, prompt(200, salt=2), trace_id, mode=pb.DISAGGREGATION_MODE_NEVER)
    t = msgs[0].timings
    assert t.queue_s > 0 and t.prefill_s > 0 and t.transfer_wait_s == 0
    assert t.queue_s + t.prefill_s == pytest.approx(t.first_token_s, rel=1e-6)
    spans = {s.name: s for s in receiver.wait_for(trace_id, {"worker.generate", "worker.queue", "worker.prefill"})}
    assert spans["worker.prefill"].duration_s == pytest.approx(t.prefill_s, rel=0.1, abs=0.002)
    assert "worker.remote_prefill" not in spans


def test_request_log_lines_carry_the_trace_id_as_json(stack):
    _, d, _ = stack
    trace_id = "2" * 32
    gone = f"127.0.0.1:{free_port()}"  # no prefill worker there: the decode worker logs and prefills locally
    msgs = generate(d, prompt(300, salt=3), trace_id, [gone])
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and msgs[-1].prefill_worker == ""
    entries = [json.loads(line) for line in d.lines if line.startswith("{")]
    [failed] = [e for e in entries if gone in e["message"]]
    assert failed["trace_id"] == trace_id and len(failed["span_id"]) == 16 and failed["level"] == "WARNING"
    assert all("trace_id" not in e for e in entries if "ready" in e["message"])  # outside a request: none
