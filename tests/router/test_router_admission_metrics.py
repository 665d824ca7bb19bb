"""The gateway exports its admission counts and open worker calls on /metrics (what the chaos soak
checks is empty once its load stops): one slow request shows as running with one open call while
it runs, and everything is back at 0 when it is answered. A real gateway, a fake worker speaking
the real gRPC (routerkit), 0.2 s per token."""

import threading
import time

import httpx
import pytest
from routerkit import FakeWorker, RouterServer, router_config

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def gateway(loop, tokenizer):
    worker = loop.run(FakeWorker(tokenizer=tokenizer, token_delay_s=0.2).start())
    server = RouterServer(loop, router_config([worker.address]), tokenizer=tokenizer).start(num_decode=1)
    yield server
    server.stop()
    loop.run(worker.stop())


def gauges(gateway) -> dict[str, float]:
    text = httpx.get(gateway.url + "/metrics", timeout=10).text
    wanted = (
        'splitserve_router_admission_requests{state="running"}',
        'splitserve_router_admission_requests{state="queued"}',
        "splitserve_router_inflight_worker_calls",
    )
    return {
        name: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        for name in wanted
        if line.startswith(name + " ")
    }


def test_admission_and_open_calls_are_exported_and_drain_to_zero(gateway):
    idle = gauges(gateway)
    assert len(idle) == 3 and set(idle.values()) == {0.0}, idle
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 15, "temperature": 0}
    answer = {}
    t = threading.Thread(
        target=lambda: answer.update(r=httpx.post(gateway.url + "/v1/completions", json=body, timeout=60))
    )
    t.start()
    deadline = time.monotonic() + 10
    while gauges(gateway)['splitserve_router_admission_requests{state="running"}'] != 1:
        assert time.monotonic() < deadline, gauges(gateway)
        time.sleep(0.05)
    assert gauges(gateway)["splitserve_router_inflight_worker_calls"] == 1
    t.join(60)
    assert answer["r"].status_code == 200
    assert set(gauges(gateway).values()) == {0.0}
