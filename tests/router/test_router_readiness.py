"""Readiness (router/core/readiness.py): the gateway lists its model on /v1/models and answers /ready
only once it can serve it, so the first request after the model list appears always succeeds;
a request that finds no worker waits up to `gateway.worker_wait_s` for one, then gets 503 with
Retry-After. Workers here are routerkit's FakeWorker (the real Worker gRPC protocol, a fake
engine) started *after* the gateway, in a race with the client, as a cold start orders them."""

import dataclasses
import threading
import time

import httpx
import pytest
from routerkit import FakeWorker, RouterServer, free_port, router_config

from splitserve.platform.errors import ConfigError
from splitserve.router.config import DisaggregationConfig, GatewayConfig, PlacementConfig

MODEL = "smollm2-135m"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3}


def poll(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def listed_models(client) -> list[str]:
    return [m["id"] for m in client.get("/v1/models").json()["data"]]


@pytest.mark.parametrize("attempt", range(20))
def test_cold_start_first_request_after_model_list_succeeds(loop, tokenizer, attempt):
    """20 cold starts: gateway up first, workers start concurrently with a client that waits for
    /v1/models and sends its request the moment the model is listed."""
    workers = [
        FakeWorker("decode", tokenizer=tokenizer, port=free_port()),
        FakeWorker("prefill", tokenizer=tokenizer, port=free_port()),
    ]
    server = RouterServer(
        loop, router_config([w.address for w in workers], gateway=GatewayConfig(worker_wait_s=0.0)), tokenizer=tokenizer
    ).start(num_decode=0)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.get("/ready").status_code == 503
            assert listed_models(client) == []
            starter = threading.Thread(
                target=lambda: [loop.run(w.start()) for w in (workers if attempt % 2 else workers[::-1])]
            )
            starter.start()
            poll(lambda: listed_models(client) == [MODEL], what="the model on /v1/models")
            r = client.post("/v1/chat/completions", json=BODY)
            assert r.status_code == 200, r.text
            assert client.get("/ready").status_code == 200
            starter.join(30)
    finally:
        server.stop()
        for w in workers:
            loop.run(w.stop())


def test_request_during_startup_waits_for_a_worker(loop, tokenizer):
    worker = FakeWorker("decode", tokenizer=tokenizer, port=free_port())
    server = RouterServer(
        loop, router_config([worker.address], gateway=GatewayConfig(worker_wait_s=60.0)), tokenizer=tokenizer
    ).start(num_decode=0)
    result = {}
    try:
        with httpx.Client(base_url=server.url, timeout=90) as client:
            sender = threading.Thread(target=lambda: result.update(r=client.post("/v1/chat/completions", json=BODY)))
            sender.start()
            poll(lambda: waiting_requests(server) == 1, what="the request to wait in the gateway")
            assert not result and worker.requests == []
            loop.run(worker.start())
            sender.join(60)
            assert result["r"].status_code == 200, result["r"].text
            assert len(worker.requests) == 1
    finally:
        server.stop()
        loop.run(worker.stop())


def waiting_requests(server) -> int:
    return server.server.config.app.state.gateway.admission.num_running


def test_no_worker_within_the_wait_gives_503_with_retry_after(loop, tokenizer):
    server = RouterServer(
        loop, router_config([f"127.0.0.1:{free_port()}"], gateway=GatewayConfig(worker_wait_s=0.3)), tokenizer=tokenizer
    ).start(num_decode=0)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            t0 = time.monotonic()
            r = client.post("/v1/chat/completions", json=BODY)
            assert time.monotonic() - t0 >= 0.3  # it did wait
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "no_worker_available"
            ready = client.get("/ready")
            assert ready.status_code == 503 and "decode worker" in ready.json()["error"]["message"]
    finally:
        server.stop()


def test_ready_requires_a_prefill_worker_when_disaggregation_is_always(loop, tokenizer):
    decode = loop.run(FakeWorker("decode", tokenizer=tokenizer).start())
    prefill = FakeWorker("prefill", tokenizer=tokenizer, port=free_port())
    placement = PlacementConfig(disaggregation=DisaggregationConfig(mode="always"))
    server = RouterServer(
        loop, router_config([decode.address, prefill.address], placement=placement), tokenizer=tokenizer
    ).start(num_decode=1)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            ready = client.get("/ready")
            assert ready.status_code == 503 and "prefill" in ready.json()["error"]["message"]
            assert listed_models(client) == []
            loop.run(prefill.start())
            poll(lambda: client.get("/ready").status_code == 200, what="/ready")
            assert listed_models(client) == [MODEL]
    finally:
        server.stop()
        for w in (decode, prefill):
            loop.run(w.stop())


@pytest.mark.parametrize("bad", [-1, 601, "5"])
def test_worker_wait_is_validated(bad):
    with pytest.raises(ConfigError, match="worker_wait_s"):
        dataclasses.replace(GatewayConfig(), worker_wait_s=bad)
