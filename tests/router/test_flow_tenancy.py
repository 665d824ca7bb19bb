"""Flow control that a client cannot game (issue findings, each reproduced and shown fixed):
a spoofed objective, fairness id or weight; 50k fresh fairness ids; a band-100 request queued
behind band 0 for a server slot; a body priority that jumps ahead of other tenants.

Classification, the bands, the controller, the slots and the pipeline are the real ones; the
workers are the detector's view of them (plain objects with a load report, as in test_flow_units)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client import CollectorRegistry, Counter
from test_flow_pipeline import origin
from test_flow_units import Clock, Worker
from test_router_pipeline import ScriptedDispatcher, chunk, prepared

from splitserve.router.config import ApiKey
from splitserve.router.config.flow import FlowControlConfig
from splitserve.router.core.pipeline import Pipeline
from splitserve.router.errors import APIError
from splitserve.router.flow.classify import classify
from splitserve.router.flow.controller import FlowController
from splitserve.router.flow.fairness import MAX_IDLE_FLOWS, Band, FlowItem
from splitserve.router.flow.metrics import FlowMetrics
from splitserve.router.flow.saturation import SaturationDetector
from splitserve.router.tenancy.admission import AdmissionPipeline, Slots
from splitserve.router.tenancy.concurrency import Concurrency
from splitserve.router.tenancy.quota import Quota

CFG = FlowControlConfig(enabled=True, objectives={"critical": 100, "batch": -1}, max_queued_per_band=4)
TEAM_A = ApiKey("", name="team-a", priority=0)
TEAM_B = ApiKey("", name="team-b", priority=10)
SHEDDABLE = ApiKey("", name="scraper", priority=-5)


def item_for(key: ApiKey, req_id: str, headers=None, cost: int = 100) -> FlowItem:
    cls = classify(CFG, headers or {}, "m", key)
    return FlowItem(req_id, cls.band, cls.flow_id, cost, cls.weight, sub_flow=cls.sub_flow, label=cls.tenant_label)


def test_a_sheddable_key_naming_critical_stays_sheddable():
    assert classify(CFG, {"x-gateway-inference-objective": "critical"}, "m", SHEDDABLE).band == -5
    assert classify(CFG, {"x-gateway-inference-objective": "critical"}, "m", TEAM_A).band == 0
    trusted = dataclasses.replace(TEAM_A, max_priority=100)
    assert classify(CFG, {"x-gateway-inference-objective": "critical"}, "m", trusted).band == 100


def test_another_tenants_fairness_id_is_a_sub_flow_of_the_callers_own_key():
    """Team-a fills the queue naming team-b's fairness id; team-b's own request still gets a place
    and the 429 goes to team-a's newest request."""

    async def steps():
        worker = Worker(num_inflight=1)
        config = dataclasses.replace(CFG, max_running_per_worker=1)
        flow = FlowController(config, SaturationDetector(config, lambda: [worker], Clock()), clock=Clock())
        spoofed = [item_for(TEAM_A, f"a{i}", {"x-gateway-inference-fairness-id": "team-b"}) for i in range(4)]
        waits = [asyncio.ensure_future(flow.acquire(it)) for it in spoofed]
        await asyncio.sleep(0)
        assert {it.flow_id for it in spoofed} == {"team-a"}
        real = dataclasses.replace(item_for(TEAM_B, "b0"), band=0)  # same band, to share the queue
        own = asyncio.ensure_future(flow.acquire(real))
        await asyncio.sleep(0.01)
        assert not own.done() and flow.bands[0].queued_of("team-b") == 1
        with pytest.raises(APIError) as err:
            await waits[-1]
        assert err.value.status == 429 and "'team-a'" in err.value.message
        for task in [*waits[:-1], own]:
            task.cancel()
        await asyncio.gather(*waits[:-1], own, return_exceptions=True)
        await flow.close()

    asyncio.run(steps())


def test_a_tiny_weight_charges_only_the_callers_own_flow():
    band = Band(0)
    b0 = item_for(TEAM_B, "b0")
    band.push(b0)
    assert band.pop() is b0
    counter_b = band.flows["team-b"].counter
    feather = dataclasses.replace(TEAM_A, weight=0.001)
    band.push(item_for(feather, "a0", {"x-gateway-inference-fairness-id": "team-b"}))
    band.pop()
    assert band.flows["team-b"].counter == counter_b
    assert band.flows["team-a"].counter == pytest.approx(100 / 0.001)


def test_50k_fresh_fairness_ids_leave_bounded_state_and_labels():
    band, metrics = Band(0), FlowMetrics(CollectorRegistry())
    for i in range(50_000):
        it = item_for(TEAM_A, f"a{i}", {"x-gateway-inference-fairness-id": f"user-{i}"})
        band.push(it)
        band.settle(band.pop(), 150)
        metrics.left(it.band, it.label, "dispatched", 0.0)
    assert list(band.flows) == ["team-a"]
    assert metrics._flows == {"team-a"}
    # keyless callers (an open gateway) are flows by address: idle ones are evicted past the bound
    for i in range(50_000):
        it = item_for(ApiKey(""), f"x{i}")
        it = dataclasses.replace(it, flow_id=f"10.0.{i // 256}.{i % 256}")
        band.push(it)
        band.settle(band.pop(), 150)
    assert len(band.flows) <= MAX_IDLE_FLOWS + 1 and len(band.idle) <= MAX_IDLE_FLOWS


def test_sub_flows_of_one_key_take_turns():
    band = Band(0)
    for i in range(4):
        band.push(item_for(TEAM_A, f"u{i}", {"x-gateway-inference-fairness-id": "user-1"}))
    band.push(item_for(TEAM_A, "v0", {"x-gateway-inference-fairness-id": "user-2"}))
    assert [band.pop().req_id for _ in range(3)] == ["u0", "v0", "u1"]


def pipeline_with_slots(num_slots: int, script):
    registry = CollectorRegistry()
    admission = AdmissionPipeline(
        Concurrency(),
        Quota(registry, clock=lambda: 1_000_000.0),
        Slots(num_slots, 16),
        Counter("rej", "", ["reason"], registry=registry),
    )
    config = dataclasses.replace(CFG, max_queued_per_band=256, latency_cap=False)  # the slots are the limit here
    clock = Clock()
    flow = FlowController(config, SaturationDetector(config, lambda: [Worker()], clock), clock=clock)
    dispatcher = ScriptedDispatcher(script)
    return Pipeline(admission, dispatcher, flow), admission, flow, dispatcher


def test_a_band_100_request_takes_the_next_slot_before_queued_band_0():
    """One server slot, held; three band-0 requests wait for it, then a band-100 one: the slot goes
    to band 100 first."""

    async def steps():
        script = {"r-0": [chunk([1], completion=1, finish="stop")]}
        pipeline, admission, flow, _ = pipeline_with_slots(1, script)
        critical = ApiKey("", name="team-b", priority=100)
        holder = await pipeline.open(TEAM_A, "m", prepared(n_choices=1), origin=origin())
        order: list[str] = []

        async def one(key: ApiKey, tag: str):
            run = await pipeline.open(key, "m", prepared(n_choices=1), origin=origin())
            order.append(tag)
            await run.close()

        tasks = [asyncio.ensure_future(one(TEAM_A, f"batch{i}")) for i in range(3)]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.ensure_future(one(critical, "critical")))
        await asyncio.sleep(0.01)
        assert admission.num_queued == 4 and order == []
        await holder.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert order[0] == "critical", order
        assert admission.num_running == 0 and flow.num_dispatched == 0
        await flow.close()

    asyncio.run(steps())


def test_a_body_priority_below_the_keys_floor_is_raised_to_it():
    async def steps():
        pipeline, _, flow, dispatcher = pipeline_with_slots(4, {"r-0": [chunk([1], completion=1, finish="stop")]})
        seen = []
        generate = dispatcher.generate

        def spy(job):
            seen.append(job.priority)
            return generate(job)

        dispatcher.generate = spy
        p = prepared(n_choices=1)
        p.jobs[:] = [dataclasses.replace(p.jobs[0], priority=-(2**31))]
        async with await pipeline.open(TEAM_A, "m", p, origin=origin()) as run:
            [c async for c in run]
        p = prepared(n_choices=1)
        p.jobs[:] = [dataclasses.replace(p.jobs[0], priority=-3)]
        trusted = dataclasses.replace(TEAM_A, min_request_priority=-10)
        async with await pipeline.open(trusted, "m", p, origin=origin()) as run:
            [c async for c in run]
        assert seen == [0, -3]
        await flow.close()

    asyncio.run(steps())
