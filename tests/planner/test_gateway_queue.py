"""The gateway's flow-control queue as a planner signal: read from the routers' /metrics, counted
as demand, and enough to scale a pool up from zero while requests wait in the gateway."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from splitserve.planner import signals as S
from splitserve.planner.config import PlannerConfig, PoolBounds
from splitserve.planner.law import Observation, Planner, PoolObservation
from splitserve.planner.plan_loop import PodScrape, PoolPlan, ServiceLoop, ServicePlan
from splitserve.planner.pods import ReadyPod
from splitserve.planner.profile import CapacityProfile, DecodePoint, PrefillPoint
from splitserve.router.flow.metrics import FlowMetrics

PROFILE = CapacityProfile(
    prefill=(PrefillPoint(128, 8000.0), PrefillPoint(8192, 8000.0)),
    decode=(DecodePoint(1000, 1, 50.0, 0.020), DecodePoint(1000, 64, 1600.0, 0.040)),
    kv_tokens=200_000,
)


def router_metrics(queued: dict[tuple[int, str], int]) -> str:
    registry = CollectorRegistry()
    metrics = FlowMetrics(registry)
    for (band, flow), n in queued.items():
        metrics.queued(band, flow, n)
    return generate_latest(registry).decode()


def test_flow_queue_is_read_summed_over_bands_and_flows():
    flat = S.flatten(router_metrics({(0, "team-a"): 7, (10, "team-b"): 2, (-1, "batch"): 1}))
    assert flat["queued"] == 10.0


def test_queued_requests_scale_decode_up_from_zero():
    cfg = PlannerConfig(itl_p90_s=0.040, headroom=0.0, prefill=PoolBounds(0, 8), decode=PoolBounds(0, 8))
    planner = Planner(cfg, PROFILE, initial={"prefill": 0, "decode": 0})
    idle = Observation(
        now=0.0,
        uncached_prompt_tokens_per_s=0.0,
        output_tokens_per_s=0.0,
        prefill=PoolObservation(0),
        decode=PoolObservation(0),
    )
    assert planner.tick(idle).desired() == {"prefill": 0, "decode": 0}
    waiting = Observation(
        now=15.0,
        uncached_prompt_tokens_per_s=0.0,
        output_tokens_per_s=0.0,
        prefill=PoolObservation(0),
        decode=PoolObservation(0),
        queued_requests=12,
        mean_prompt_tokens=200,
        mean_output_tokens=128,
    )
    decision = planner.tick(waiting)
    assert decision.decode.desired == 1 and decision.decode.reason == "scale_up"
    assert decision.decode.demand == 12 * 128 / cfg.queue_drain_s
    assert decision.prefill.desired == 1


def test_service_loop_passes_the_routers_queue_to_the_law():
    pool = PoolPlan("d", "app=x", 0, 4)
    plan = ServicePlan(
        namespace="ns",
        name="svc",
        ttft_p90_ms=2000,
        itl_p90_ms=100,
        export="keda",
        prefill=pool,
        decode=pool,
        router_selector="app=r",
        router_metrics_port=9000,
        worker_metrics_port=9001,
    )
    loop = ServiceLoop(plan, Planner(PlannerConfig(), PROFILE))
    pods = {"prefill": PoolObservation(0), "decode": PoolObservation(0)}
    router = ReadyPod(name="r-1", ip="10.0.0.1", age_s=100.0)
    flat = S.flatten(router_metrics({(0, "team-a"): 5}))
    observation = loop.observe(10.0, pods, [PodScrape("router", router, flat)])
    assert observation.queued_requests == 5.0
