"""One request, one trace: `splitserve up` (P/D, KV over tcp) exporting to an OTLP receiver.

The receiver is opentelemetry-proto's TraceService over grpcio (tests/otlp_receiver.py): the
collector's real protocol. A streamed chat request with a client `traceparent` must give one
trace with that id, holding the gateway's spans (parse, admission and its gates, placement,
dispatch, stream), the decode worker's, the prefill worker's and both ends of the KV transfer,
each under the right parent; the spans must tell the TTFT the client saw within 10 %; and
`splitserve trace` prints the tree from the exported spans.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import pytest
from otlp_receiver import OtlpReceiver
from workerproc import CLI, free_port

pytestmark = pytest.mark.slow

TRACE = "5c1d2e3f4a5b6c7d8e9fa0b1c2d3e4f5"
CLIENT_SPAN = "a1b2c3d4e5f60718"
PROMPT = "Summarise these notes. " + " ".join(f"Note {i}: the tide came in at {i} o'clock." for i in range(40))
GATEWAY = {
    "gateway.request",
    "gateway.parse",
    "gateway.admission",
    "admission.rate_limit",
    "admission.key_concurrency",
    "admission.quota",
    "admission.slot",
    "gateway.placement",
    "gateway.dispatch",
    "gateway.stream",
}
DECODE = {
    "worker.generate",
    "worker.queue",
    "worker.remote_prefill",
    "prefill.call",
    "kv.receive",
    "worker.first_token",
}
PREFILL = {"prefill.request", "prefill.queue", "prefill.compute", "kv.send"}


@pytest.fixture(scope="module")
def traced_up():
    with OtlpReceiver() as receiver:
        port = free_port()
        proc = subprocess.Popen(
            [
                CLI,
                "up",
                "--port",
                str(port),
                "--kv-transport",
                "tcp",
                "--kv-cache-memory",
                "0.25",
                "--otlp-traces-endpoint",
                receiver.endpoint,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OTEL_BSP_SCHEDULE_DELAY": "200"},
        )
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        deadline = time.monotonic() + 300
        while not any("splitserve up: serving" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-40:])
            time.sleep(0.2)
        try:
            yield receiver, f"http://127.0.0.1:{port}/v1", lines
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_one_trace_from_the_gateway_through_both_workers(traced_up, tmp_path):
    import openai

    receiver, base_url, _ = traced_up
    client = openai.OpenAI(
        base_url=base_url,
        api_key="none",
        max_retries=0,
        timeout=300,
    )
    # One untraced request first, on the same client: its connection and the client's lazy setup
    # are then outside the measured TTFT, which the spans cannot see.
    list(
        client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}], max_tokens=1, stream=True
        )
    )
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        stream=True,
        extra_headers={"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"},
    )
    ttft = None
    request_id = ""
    for chunk in stream:
        request_id = chunk.id
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - t0
    assert ttft is not None

    spans = receiver.wait_for(TRACE, GATEWAY | DECODE | PREFILL, timeout=60)
    by_name = {s.name: s for s in spans}
    assert set(by_name) >= GATEWAY | DECODE | PREFILL, sorted(set(by_name))
    assert {s.trace_id for s in spans} == {TRACE}
    assert {s.service for s in spans} == {"splitserve-router", "splitserve-decode", "splitserve-prefill"}
    parent = {name: s.parent_id for name, s in by_name.items()}
    ids = {name: s.span_id for name, s in by_name.items()}
    assert parent["gateway.request"] == CLIENT_SPAN  # the client's context is honoured
    for child in (
        "gateway.parse",
        "gateway.admission",
        "admission.rate_limit",
        "gateway.placement",
        "gateway.dispatch",
        "gateway.stream",
    ):
        assert parent[child] == ids["gateway.request"], child
    for gate in ("admission.key_concurrency", "admission.quota", "admission.slot"):
        assert parent[gate] == ids["gateway.admission"], gate
    assert parent["worker.generate"] == ids["gateway.dispatch"]  # across the gateway's gRPC call
    assert parent["prefill.call"] == ids["worker.remote_prefill"]
    assert parent["kv.receive"] == parent["prefill.request"] == ids["prefill.call"]  # across the decode's call
    assert parent["kv.send"] == ids["prefill.request"]
    send, receive = by_name["kv.send"].attributes, by_name["kv.receive"].attributes
    assert send["splitserve.kv.transfer_id"] == receive["splitserve.kv.transfer_id"]
    assert send["splitserve.kv.num_bytes"] == receive["splitserve.kv.num_bytes"] > 0
    assert send["splitserve.kv.path"] == receive["splitserve.kv.path"] == "tcp"
    placement = by_name["gateway.placement"].attributes
    assert placement["splitserve.placement.reason"] == "remote prefill"
    assert placement["splitserve.placement.decode"] == by_name["gateway.dispatch"].attributes["server.address"]
    assert placement["splitserve.placement.prefill"] == [by_name["prefill.call"].attributes["server.address"]]
    assert any(k.startswith("splitserve.placement.score.") for k in placement)
    request = by_name["gateway.request"].attributes
    assert request["gen_ai.request.model"] == "smollm2-135m" and request["gen_ai.operation.name"] == "chat"
    assert request["splitserve.request_id"] == request_id and request["http.response.status_code"] == 200
    assert by_name["gateway.stream"].attributes["gen_ai.usage.output_tokens"] == 8
    assert by_name["worker.generate"].attributes["gen_ai.usage.input_tokens"] == request["gen_ai.usage.input_tokens"]

    # The spans tell the TTFT the client saw: the request's start to the stream's first token,
    # and the phases under it add up (parse + admission + placement + the decode worker's TTFT
    # + the gRPC hops between them).
    traced_ttft = by_name["gateway.stream"].start_s - by_name["gateway.request"].start_s
    assert traced_ttft == pytest.approx(ttft, rel=0.1)
    worker_ttft = by_name["worker.first_token"].end_s - by_name["worker.generate"].start_s
    assert worker_ttft <= traced_ttft and worker_ttft == pytest.approx(traced_ttft, rel=0.1)
    phases = sum(by_name[n].duration_s for n in ("worker.queue", "worker.remote_prefill", "worker.first_token"))
    assert phases == pytest.approx(worker_ttft, rel=0.1)

    header, depth = receiver.shown_tree(CLI, request_id, tmp_path)
    assert re.match(rf"trace {TRACE}: \d+ spans", header)
    assert depth["gateway.request"] < depth["gateway.dispatch"] < depth["worker.generate"] < depth["prefill.request"]
