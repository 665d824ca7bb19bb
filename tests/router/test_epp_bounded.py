"""The EPP does bounded work whoever sends the body: a real `splitserve epp` process (ext_proc
over mTLS, as a gateway calls it) over fake workers that speak the real Worker protocol, fed
1 MiB bodies of 50,000 prompts x n=16 from a client with no API key, as a gateway forwards them.

While those bodies arrive its /health keeps answering (p99 under 100 ms, or, on a machine too
loaded for that, within twice what the same probe gets there without them), its memory stays
put (RSS growth under 50 MB) and another caller's ordinary requests are still picked. Each
such body is a 400 naming the gateway's cap, decided from the raw JSON before anything is
validated, tokenized or placed.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time

import grpc
import psutil
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from eppkit import CliProcess, PoolMember
from routerkit import FakeWorker, free_port
from workerproc import security

NUM_ATTACKS = 24
ATTACKERS = 2


@pytest.fixture(scope="module")
def epp(loop, tokenizer):
    decode = [loop.run(FakeWorker(tokenizer=tokenizer).start()) for _ in range(2)]
    members = [PoolMember(f"member-{i}") for i in range(2)]
    grpc_port, health_port = free_port(), free_port()
    tls = security().tls
    process = CliProcess(
        "epp",
        [
            "epp",
            "--workers",
            ",".join(w.address for w in decode),
            *[f"--endpoint={w.address}={m.address}" for w, m in zip(decode, members, strict=True)],
            "--grpc-port",
            str(grpc_port),
            "--health-port",
            str(health_port),
            "--serve-tls-cert",
            tls.cert,
            "--serve-tls-key",
            tls.key,
            "--serve-tls-client-ca",
            tls.ca,
        ],
    )
    process.wait(f"http://127.0.0.1:{health_port}/ready")
    with open(tls.ca, "rb") as ca, open(tls.key, "rb") as key, open(tls.cert, "rb") as cert:
        credentials = grpc.ssl_channel_credentials(ca.read(), key.read(), cert.read())
    try:
        yield {"proc": process, "address": f"127.0.0.1:{grpc_port}", "health": health_port, "creds": credentials}
    finally:
        process.stop()
        for m in members:
            m.close()

        async def stop():
            for w in decode:
                await w.stop()

        loop.run(stop())


def headers(path: str) -> ep.ProcessingRequest:
    values = {":method": "POST", ":path": path, "content-type": "application/json"}  # no authorization
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    )
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=header_map))


def exchange(epp, path: str, body: bytes) -> ep.ProcessingResponse:
    """One request's headers and whole body on one stream; the EPP's answer to the body."""
    with grpc.secure_channel(epp["address"], epp["creds"], options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        messages = [headers(path), ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))]
        answers = list(ep_grpc.ExternalProcessorStub(ch).Process(iter(messages), timeout=60))
    return answers[-1]


PROBER = """
import json, sys, time, urllib.request
url, seconds = sys.argv[1], float(sys.argv[2])
out, end = [], time.monotonic() + seconds
while time.monotonic() < end:
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            ok = r.status == 200
    except OSError:
        ok = False
    out.append(time.perf_counter() - t0 if ok else float("inf"))
    if select.select([sys.stdin], [], [], 0.01)[0]:  # "stop" (or the test gone)
        break
print(json.dumps(out))
"""


def start_prober(url: str, seconds: float = 600) -> subprocess.Popen:
    """/health probed every 10 ms from a process of its own (this one's threads would share its
    interpreter lock with the probe and slow it down), until stop_prober or `seconds`."""
    code = "import select\n" + PROBER
    return subprocess.Popen(
        [sys.executable, "-c", code, url, str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def stop_prober(prober: subprocess.Popen) -> list[float]:
    out, _ = prober.communicate("stop\n", timeout=60)
    return [float(x) for x in json.loads(out)]


def probe_health(url: str, seconds: float) -> list[float]:
    prober = start_prober(url)
    time.sleep(seconds)
    return stop_prober(prober)


def test_a_mebibyte_of_prompts_keeps_health_memory_and_other_callers_fine(epp):
    prompts = [f"prompt number {i:05d}" for i in range(50_000)]
    attack = json.dumps({"model": "smollm2-135m", "prompt": prompts, "n": 16}).encode()
    assert 1 << 20 <= len(attack) < 1.2 * (1 << 20)
    ordinary = json.dumps({"model": "smollm2-135m", "prompt": "Hello there", "max_tokens": 4}).encode()
    assert exchange(epp, "/v1/completions", ordinary).request_body.response.header_mutation.set_headers
    process = psutil.Process(epp["proc"].proc.pid)
    rss_before = process.memory_info().rss

    done = threading.Event()
    url = f"http://127.0.0.1:{epp['health']}/health"
    quiet = probe_health(url, 2.0)  # with nobody sending: what this machine gives now
    prober = start_prober(url)
    refusals: list[ep.ProcessingResponse] = []

    def attacker():
        for _ in range(NUM_ATTACKS // ATTACKERS):
            refusals.append(exchange(epp, "/v1/completions", attack))

    picked: list[bool] = []

    def other_caller():
        while not done.is_set():
            answer = exchange(epp, "/v1/completions", ordinary)
            picked.append(bool(answer.request_body.response.header_mutation.set_headers))

    threads = [threading.Thread(target=attacker) for _ in range(ATTACKERS)]
    helper = threading.Thread(target=other_caller)
    for t in [helper, *threads]:
        t.start()
    for t in threads:
        t.join(300)
    done.set()
    helper.join(60)
    latencies = stop_prober(prober)

    assert len(refusals) == NUM_ATTACKS
    for answer in refusals:
        assert answer.immediate_response.status.code == 400
        assert "800000 choices" in json.loads(answer.immediate_response.body)["error"]["message"]
    assert picked and all(picked), "another caller's request was not picked"
    p99, quiet_p99 = (statistics.quantiles(x, n=100)[98] for x in (latencies, quiet))
    growth_mb = (process.memory_info().rss - rss_before) / 1e6
    print(
        f"health p99 {p99 * 1000:.1f} ms over {len(latencies)} probes under attack, {quiet_p99 * 1000:.1f} ms "
        f"quiet; RSS growth {growth_mb:.1f} MB"
    )
    # Under 100 ms on a machine of our own (docs/reliability.md has the figures); on a shared,
    # loaded one the bound is what the same probe gets there without the attack, twice.
    assert p99 < max(0.1, 2 * quiet_p99), f"health p99 {p99 * 1000:.0f} ms, {quiet_p99 * 1000:.0f} ms quiet"
    assert growth_mb < 50, f"RSS grew {growth_mb:.0f} MB"
