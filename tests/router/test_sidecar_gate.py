"""The sidecar's x-prefiller-host-port gate against its pool as discovery and probes fill it.

A sidecar that has just started knows the pool's addresses (discovery) before their roles (each
worker's first WorkerInfo). The EPP, running longer, may already name one of them: the gate waits
for that worker's role instead of refusing a good request (CI once lost the first request after
a sidecar restart this way). An address discovery never listed, or a decode worker, is refused
at once. In-process: the real sidecar app with its pool filled by hand.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from prometheus_client import CollectorRegistry, Counter
from routerkit import router_config

from splitserve.router.epp.sidecar import PrefillerGate, build, prefiller

LOCAL, PREFILL, OTHER_DECODE = "127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"


def gate_for(wait_s: float):
    config = router_config(workers=[PREFILL, OTHER_DECODE])
    config = dataclasses.replace(config, gateway=dataclasses.replace(config.gateway, worker_wait_s=wait_s))
    router, _ = build(config, LOCAL)
    seen = []

    async def app(scope, receive, send):
        seen.append(prefiller.get())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    return router, PrefillerGate(app, router, _counter()), seen


def _counter() -> Counter:
    return Counter("refused", "refused", registry=CollectorRegistry())


async def call(gate, named: str, method: str = "POST", path: str = "/v1/completions") -> tuple[int, dict]:
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    headers = [(b"x-prefiller-host-port", named.encode())] if named else []
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    await gate(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


def test_a_discovered_worker_whose_role_arrives_late_is_waited_for_not_refused():
    router, gate, seen = gate_for(wait_s=5.0)
    pool = router.pool
    for address in (PREFILL, OTHER_DECODE):
        pool.add(address)  # discovery listed them; no probe has answered yet

    async def scenario():
        async def probe_answers():
            await asyncio.sleep(0.3)
            pool.workers[PREFILL].role = "prefill"

        task = asyncio.create_task(probe_answers())
        status, _ = await call(gate, PREFILL)
        await task
        return status

    assert asyncio.run(scenario()) == 200
    assert seen == [PREFILL]


def test_an_unknown_address_or_a_decode_worker_is_refused_at_once():
    router, gate, seen = gate_for(wait_s=30.0)
    router.pool.add(OTHER_DECODE).role = "decode"
    router.pool.add(LOCAL).role = "decode"
    for bad in ("10.9.9.9:1", OTHER_DECODE, LOCAL):
        t0 = time.monotonic()
        status, body = asyncio.run(call(gate, bad))
        assert status == 400 and body["error"]["code"] == "invalid_prefiller", bad
        assert time.monotonic() - t0 < 5.0, f"{bad}: the refusal waited for worker_wait_s"
    assert seen == []


def test_a_listed_worker_that_never_answers_is_refused_after_the_wait():
    router, gate, seen = gate_for(wait_s=0.3)
    router.pool.add(PREFILL)
    t0 = time.monotonic()
    status, _ = asyncio.run(call(gate, PREFILL))
    assert status == 400 and time.monotonic() - t0 >= 0.3
    assert seen == []


def test_the_probes_are_answered_by_the_gate_with_the_apps_answers():
    """The EPP probes each sidecar five times a second: /ready and /health are answered before
    the gateway app, with what its own routes would say (readiness.ready_answer)."""
    router, gate, seen = gate_for(wait_s=5.0)
    status, body = asyncio.run(call(gate, "", "GET", "/ready"))
    assert status == 503 and body["error"]["code"] == "no_worker_available"
    assert "decode worker" in body["error"]["message"]
    local = router.pool.add(LOCAL)
    local.role, local.is_connected = "decode", True
    router.pool.add(PREFILL).role = "prefill"
    status, body = asyncio.run(call(gate, "", "GET", "/ready"))
    assert (status, body["status"], body["healthy_decode_workers"]) == (200, "ready", 1)
    assert asyncio.run(call(gate, "", "GET", "/health")) == (200, {"status": "ok"})
    assert seen == []  # the app behind never saw a probe
    status, _ = asyncio.run(call(gate, "", "POST", "/ready"))  # not a probe: the app answers
    assert status == 200 and seen == [""]
