"""`splitserve planner` (planner/cli.py): demand scraped from a router's real metrics registry,
served over HTTP, becomes the desired counts KEDA reads; an unreadable router holds."""

from __future__ import annotations

import json
import urllib.request

from prometheus_client import start_http_server
from workerproc import free_port

from splitserve.planner.cli import PlannerProcess
from splitserve.planner.config import PlannerConfig, PoolBounds
from splitserve.planner.law import Planner
from splitserve.planner.profile import CapacityProfile, DecodePoint, PrefillPoint
from splitserve.planner.server import DesiredStore, serve
from splitserve.router.metrics import RouterMetrics

PROFILE = CapacityProfile(
    prefill=(PrefillPoint(512, 1000.0),),
    decode=(DecodePoint(512, 1, 20.0, 0.05), DecodePoint(512, 8, 80.0, 0.1)),
    kv_tokens=100_000,
)


def test_planner_process_turns_router_counters_into_desired_replicas():
    metrics = RouterMetrics()
    for role in ("prefill", "decode"):
        metrics.workers.labels(role=role, state="healthy").set(1)
    port = free_port()
    router_http, _ = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    cfg = PlannerConfig(ttft_p90_s=2.0, itl_p90_s=0.1, prefill=PoolBounds(1, 8), decode=PoolBounds(1, 8))
    store = DesiredStore()
    planner_http = serve(store, "127.0.0.1", free_port())
    proc = PlannerProcess(Planner(cfg, PROFILE), store, "ns", "svc", [f"http://127.0.0.1:{port}/metrics"])
    try:
        proc.tick(0.0)  # first sample: no rate yet → hold
        assert store.desired("ns", "svc")["reasons"] == {
            "prefill": "hold_missing_metrics",
            "decode": "hold_missing_metrics",
        }
        metrics.count_tokens(30_000, 640, True)  # 10 s of 3,000 prompt and 64 output tokens/s
        proc.tick(10.0)
        body = json.loads(
            urllib.request.urlopen(f"http://127.0.0.1:{planner_http.server_port}/v1/desired/ns/svc", timeout=30).read()
        )
        # prefill: ceil(3,300 / 800) = 5, at most doubling from 1 → 2; decode: ceil(70.4 / 64) = 2.
        assert (body["prefill"], body["decode"]) == (2, 2)
        router_http.shutdown()
        router_http.server_close()  # connections are refused now
        proc.tick(20.0)  # the router cannot be read: hold
        assert store.desired("ns", "svc")["prefill"] == 2
        assert store.desired("ns", "svc")["reasons"]["prefill"] == "hold_missing_metrics"
    finally:
        planner_http.shutdown()
        planner_http.server_close()
        router_http.server_close()  # idempotent


def test_planner_process_trims_on_measured_ttft_and_itl():
    """The router's TTFT histogram and a decode worker's ITL and KV-transfer histograms (their real
    metrics objects, over HTTP): demand one replica each can carry, but a measured ITL p90 above the
    100 ms SLO adds one decode replica; a TTFT within the SLO adds none."""
    from splitserve.workers.metrics import WorkerMetrics

    router, worker = RouterMetrics(), WorkerMetrics("decode", "m")
    for role in ("prefill", "decode"):
        router.workers.labels(role=role, state="healthy").set(1)
    servers = [start_http_server(0, addr="127.0.0.1", registry=reg) for reg in (router.registry, worker.registry)]
    (rport, wport) = (srv.server_address[1] for srv, _ in servers)
    cfg = PlannerConfig(ttft_p90_s=2.0, itl_p90_s=0.1, prefill=PoolBounds(1, 8), decode=PoolBounds(1, 8))
    store = DesiredStore()
    proc = PlannerProcess(
        Planner(cfg, PROFILE),
        store,
        "ns",
        "svc",
        [f"http://127.0.0.1:{rport}/metrics"],
        [f"http://127.0.0.1:{wport}/metrics"],
    )
    try:
        proc.tick(0.0)
        router.count_tokens(1000, 100, True)  # 100 prompt and 10 output tokens/s: light
        for _ in range(20):
            router.ttft.observe(0.4)
            worker.itl.observe(0.2)
            worker.kv_transfer_seconds.labels(direction="in").observe(0.01)
        proc.tick(10.0)
        d = store.desired("ns", "svc")
        assert (d["prefill"], d["decode"]) == (1, 2)
        assert d["reasons"]["decode"] == "scale_up"
    finally:
        for srv, _thread in servers:
            srv.shutdown()
            srv.server_close()
