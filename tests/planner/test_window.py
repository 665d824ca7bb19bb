"""Measured latency into the local planner (`splitserve up --planner`): planner/window.py's
sliding window over cumulative scrapes on hand-computed cases, and launch/up_planner.py's loop
reading the real router metrics object and a decode worker's real metrics over HTTP, so a
measured ITL above the SLO makes the law trim the decode pool up by one."""

from __future__ import annotations

import asyncio
import types

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest, start_http_server

from splitserve.launch.up_planner import LocalPlannerLoop
from splitserve.planner import signals as S
from splitserve.planner.config import PlannerConfig
from splitserve.planner.law import Planner
from splitserve.planner.profile import CapacityProfile, DecodePoint, PrefillPoint
from splitserve.planner.window import ScrapeWindow, measured_latency
from splitserve.router.metrics import RouterMetrics
from splitserve.workers.metrics import WorkerMetrics


def _itl_scrape(reg) -> dict[str, float]:
    return S.flatten(generate_latest(reg).decode())


def test_window_counts_only_what_happened_within_it():
    reg = CollectorRegistry()
    h = Histogram("splitserve_inter_token_latency_seconds", "", buckets=(0.1, 0.2, 0.4), registry=reg)
    w = ScrapeWindow(30.0)
    for _ in range(100):
        h.observe(0.05)  # old, fast tokens
    w.add(0.0, "decode/a", _itl_scrape(reg))
    assert w.delta("decode/") == {}  # one scrape is a baseline, not a sample
    for _ in range(10):
        h.observe(0.3)  # slow tokens within the window
    w.add(10.0, "decode/a", _itl_scrape(reg))
    d = w.delta("decode/")
    assert d["itl/count"] == 10 and abs(S.p90(d, "itl") - 0.38) < 1e-9  # 0.2 + 0.2 × 9/10
    for _ in range(90):
        h.observe(0.05)
    w.add(40.0, "decode/a", _itl_scrape(reg))  # the baseline moves to t=10: only the fast 90
    d = w.delta("decode/")
    assert d["itl/count"] == 90 and S.p90(d, "itl") <= 0.1
    w.add(50.0, "decode/a", None)  # an unreadable scrape changes nothing
    assert w.delta("decode/")["itl/count"] == 90
    w.keep_only({"router"})  # the worker was stopped: its samples go
    assert w.delta("decode/") == {}
    with pytest.raises(ValueError, match="window_s"):
        ScrapeWindow(0)


def test_ttft_for_prefill_is_the_routers_p90_minus_the_kv_transfer_and_none_without_samples():
    router = {"rttft/le/1.0": 0.0, "rttft/le/2.0": 10.0, "rttft/le/+Inf": 10.0, "rttft/count": 10.0}
    decode = {"kvt/sum": 0.5, "kvt/count": 10.0, "itl/le/0.1": 10.0, "itl/le/+Inf": 10.0, "itl/count": 10.0}
    ttft, itl = measured_latency(router, decode)
    assert abs(ttft - (1.9 - 0.05)) < 1e-9 and abs(itl - 0.09) < 1e-9
    assert measured_latency({}, {}) == (None, None)  # nothing measured: no trim, not "zero latency"


PROFILE = CapacityProfile(
    prefill=(PrefillPoint(64, 1000.0), PrefillPoint(2048, 1000.0)),
    decode=(DecodePoint(256, 1, 20.0, 0.05), DecodePoint(256, 4, 40.0, 0.1)),
    kv_tokens=100000,
)


class _Proc:
    def __init__(self, address: str, metrics_url: str):
        self.address, self.metrics_url = address, metrics_url


def test_local_loop_feeds_measured_latency_to_the_law():
    """The decode worker's real WorkerMetrics served over HTTP; the router's real RouterMetrics in
    process. Light demand (one decode worker is enough by the profile) but a measured ITL p90 of
    ~0.24 s against a 0.1 s SLO: the law's trim asks for a second decode worker."""
    worker = WorkerMetrics("decode", "m")
    server, thread = start_http_server(0, addr="127.0.0.1", registry=worker.registry)
    try:
        port = server.server_address[1]
        router = types.SimpleNamespace(
            metrics=RouterMetrics(), pool=types.SimpleNamespace(decode_workers=lambda: [], workers={})
        )
        cfg = PlannerConfig(ttft_p90_s=2.0, itl_p90_s=0.1, tick_s=1.0, peak_window_s=2.0, budget=4)
        workers = {
            "prefill": [_Proc("p", "unused")],
            "decode": [_Proc("127.0.0.1:1", f"http://127.0.0.1:{port}/metrics")],
        }
        spawned = []
        loop = LocalPlannerLoop(Planner(cfg, PROFILE), router, spawned.append, workers, tick_s=1.0)
        loop._start = spawned.append  # record the decision, start no process

        async def two_ticks():
            await loop.scrape(0.0)
            loop.observe(0.0)
            for _ in range(20):
                worker.itl.observe(0.24)  # tokens slower than the 100 ms SLO
                router.metrics.ttft.observe(0.3)
            router.metrics.count_tokens(200, 20, is_first=True)
            await loop.scrape(1.0)
            return loop.observe(1.0)

        obs = asyncio.run(two_ticks())
        assert obs.itl_p90_s is not None and 0.1 < obs.itl_p90_s <= 0.25
        assert obs.ttft_p90_s is not None and 0.25 < obs.ttft_p90_s <= 0.5
        decision = loop.planner.tick(obs)
        assert decision.decode.trim == 1 and decision.decode.desired == 2
        assert decision.prefill.trim == 0 and decision.prefill.desired == 1
    finally:
        server.shutdown()
        thread.join(10)


def test_without_streamed_responses_the_decode_workers_ttft_stands_in():
    """The router observes TTFT only for streams; a window of non-streaming requests still has a
    TTFT signal: the decode workers' own histogram (arrival at the worker to the first token)."""
    worker = WorkerMetrics("decode", "m")
    w = ScrapeWindow(30.0)
    w.add(0.0, "decode/a", _itl_scrape(worker.registry))
    for _ in range(10):
        worker.ttft.observe(3.0)  # in (2.5, 5]
        worker.kv_transfer_seconds.labels(direction="in").observe(0.2)
    w.add(5.0, "decode/a", _itl_scrape(worker.registry))
    ttft, itl = measured_latency({}, w.delta("decode/"))
    assert abs(ttft - (2.5 + 2.5 * 9 / 10 - 0.2)) < 1e-9 and itl is None
