"""Flow control on plain objects: bands, fair queuing in tokens, the saturation detector,
the controller's bounds (503 vs 429, Retry-After), shedding, disconnects and metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from splitserve.platform.errors import ConfigError
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router.config import ApiKey
from splitserve.router.config.flow import FlowControlConfig, from_mapping
from splitserve.router.errors import APIError
from splitserve.router.flow.classify import classify
from splitserve.router.flow.controller import FlowController
from splitserve.router.flow.fairness import Band, FlowItem
from splitserve.router.flow.metrics import FlowMetrics
from splitserve.router.flow.saturation import SaturationDetector


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Worker:
    """The WorkerState fields the detector reads."""

    load: pb.LoadReport | None = field(default_factory=pb.LoadReport)
    address: str = "d:1"
    load_time: float = 100.0
    num_pending: int = 0
    num_inflight: int = 0
    role: str = "decode"
    healthy: bool = True

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "both")

    def is_healthy(self, now: float) -> bool:
        return self.healthy


def item(req_id: str, flow: str = "a", band: int = 0, cost: int = 100, weight: float = 1.0, priority: int = 0):
    return FlowItem(req_id=req_id, band=band, flow_id=flow, cost_tokens=cost, weight=weight, priority=priority)


# -- fair queuing -----------------------------------------------------------------------------
def test_equal_weights_share_tokens_whatever_the_backlog():
    band = Band(0)
    for i in range(32):
        band.push(item(f"a{i}", "a"))
    for i in range(4):
        band.push(item(f"b{i}", "b"))
    order = [band.pop().flow_id for _ in range(8)]
    assert order.count("a") == 4 and order.count("b") == 4, order


def test_weights_split_tokens_in_proportion():
    band = Band(0)
    for i in range(30):
        band.push(item(f"a{i}", "a", weight=2.0))
        band.push(item(f"b{i}", "b", weight=1.0))
    order = [band.pop().flow_id for _ in range(30)]
    assert order.count("a") == 20 and order.count("b") == 10


def test_charge_is_settled_to_actual_use():
    band = Band(0)
    a0, b0 = item("a0", "a", cost=1000), item("b0", "b", cost=1000)
    band.push(a0)
    band.push(b0)
    assert band.pop() is a0 and band.pop() is b0
    band.settle(a0, 100)  # a used 100 of its 1000: it is owed the difference
    band.push(item("a1", "a"))
    band.push(item("b1", "b"))
    assert band.pop().flow_id == "a"


def test_an_idle_flow_banks_no_credit():
    band = Band(0)
    for i in range(10):
        band.push(item(f"a{i}", "a"))
    for _ in range(5):
        band.pop()
    band.push(item("b0", "b"))
    band.push(item("b1", "b"))
    # b arrives late: it is lifted to a's counter, so it alternates with a instead of taking five turns.
    order = [band.pop().flow_id for _ in range(4)]
    assert order == ["b", "a", "b", "a"] or order == ["a", "b", "a", "b"], order


def test_body_priority_orders_within_a_flow_then_arrival():
    band = Band(0)
    band.push(item("x", priority=5))
    band.push(item("y", priority=-1))
    band.push(item("z", priority=5))
    assert [band.pop().req_id for _ in range(3)] == ["y", "x", "z"]


def test_remove_and_idle_flows_are_forgotten():
    band = Band(0)
    x = item("x")
    band.push(x)
    assert band.remove(x) and not band.remove(x)
    assert band.num_queued == 0 and band.flows == {}


# -- classification --------------------------------------------------------------------------
def test_band_comes_from_model_default_then_key_then_zero_and_a_header_moves_it_within_the_key():
    cfg = FlowControlConfig(enabled=True, objectives={"chat": 10, "batch": -1}, default_objectives={"m2": "batch"})
    chat = {"x-gateway-inference-objective": "chat"}
    batch = {"x-gateway-inference-objective": "batch"}
    key = ApiKey("", name="k", priority=3)
    assert classify(cfg, {}, "m2", key).band == -1
    assert classify(cfg, {}, "m", key).band == 3
    assert classify(cfg, {}, "m", ApiKey("", name="k")).band == 0
    assert classify(cfg, batch, "m", key).band == -1  # lowering is free
    assert classify(cfg, chat, "m", key).band == 3  # raising needs max_priority
    assert classify(cfg, chat, "m", ApiKey("", name="k", priority=3, max_priority=5)).band == 5
    assert classify(cfg, chat, "m", ApiKey("", name="k", priority=3, max_priority=50)).band == 10
    with pytest.raises(APIError) as exc:
        classify(cfg, {"x-gateway-inference-objective": "nope"}, "m", key)
    assert exc.value.status == 400 and "batch, chat" in exc.value.message


def test_flow_is_the_key_and_the_header_only_a_sub_flow_under_it():
    cfg = FlowControlConfig(enabled=True)
    own = classify(cfg, {"x-gateway-inference-fairness-id": "t1"}, "m", ApiKey("", name="k"), client="1.2.3.4")
    assert (own.flow_id, own.sub_flow, own.tenant_label) == ("k", "t1", "k")
    assert classify(cfg, {}, "m", ApiKey("", name="k"), client="1.2.3.4").flow_id == "k"
    keyless = classify(cfg, {}, "m", ApiKey(""), client="1.2.3.4")
    assert (keyless.flow_id, keyless.tenant_label) == ("1.2.3.4", "anonymous")
    assert classify(cfg, {}, "m", ApiKey("", name="k", weight=3.0)).weight == 3.0
    with pytest.raises(APIError, match="printable"):
        classify(cfg, {"x-gateway-inference-fairness-id": "a b"}, "m", ApiKey(""))


def test_config_rejects_what_it_cannot_use():
    with pytest.raises(ConfigError, match="not an objective"):
        FlowControlConfig(objectives={"chat": 1}, default_objectives={"m": "batch"})
    with pytest.raises(ConfigError, match="max_running_per_worker"):
        FlowControlConfig(max_running_per_worker=2, reserved_running=2)
    with pytest.raises(ConfigError, match="kv_cache_threshold"):
        FlowControlConfig(kv_cache_threshold=2)
    with pytest.raises(ConfigError, match="allowed"):
        from_mapping({"objectivs": {}})


# -- saturation ------------------------------------------------------------------------------
def test_detector_thresholds_and_reserved_headroom():
    clock = Clock()
    w1, w2 = Worker(), Worker()
    cfg = FlowControlConfig(enabled=True, max_running_per_worker=4, reserved_running=1, reserved_min_band=1)
    det = SaturationDetector(cfg, lambda: [w1, w2], clock)
    assert det.has_room(0, 0)
    w1.num_inflight = w2.num_inflight = 3
    assert not det.has_room(0, 6)  # band 0 may fill 3 of 4 slots
    assert det.has_room(10, 6)  # the reserved slot is band 10's
    assert not det.has_room(10, 8)  # released requests count before workers report them
    w1.num_inflight = w2.num_inflight = 0
    w1.load = pb.LoadReport(num_waiting=5)
    w2.load = pb.LoadReport(kv_usage=0.9)
    assert not det.has_room(10, 0) and det.is_saturated()
    w2.load = pb.LoadReport()
    clock.now += 10  # stale reports count as full
    assert not det.has_room(10, 0)
    w1.load_time = w2.load_time = clock.now
    w1.load = pb.LoadReport()
    assert det.has_room(0, 0)
    w1.healthy = False
    w2.load = pb.LoadReport(draining=True)
    assert not det.has_room(10, 0)  # no decode worker: requests wait (scale from zero)


# -- the controller --------------------------------------------------------------------------
class Gate:
    """A detector stand-in with a fixed number of slots, for controller tests."""

    def __init__(self, slots: int):
        self.slots = slots

    def has_room(self, band: int, num_dispatched: int, num_reserved_dispatched: int = 0) -> bool:
        return num_dispatched < self.slots

    def is_saturated(self) -> bool:
        return not self.has_room(0, 0)


def queue_length(registry: CollectorRegistry, band: int) -> float:
    """The queue gauge of `band`, summed over its flows (what the planner and KEDA read)."""
    return sum(
        s.value
        for metric in registry.collect()
        for s in metric.samples
        if s.name == "splitserve_router_flow_queue_length" and s.labels["band"] == str(band)
    )


def counts(registry: CollectorRegistry) -> dict[tuple[str, str, str], float]:
    out = {}
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == "splitserve_router_flow_requests_total":
                out[(s.labels["band"], s.labels["flow"], s.labels["outcome"])] = s.value
    return out


def controller(slots: int, **cfg) -> tuple[FlowController, Gate, CollectorRegistry]:
    registry = CollectorRegistry()
    gate = Gate(slots)
    return FlowController(FlowControlConfig(enabled=True, **cfg), gate, FlowMetrics(registry)), gate, registry


@pytest.mark.asyncio
async def test_higher_band_goes_first_and_each_request_is_counted_once():
    ctl, gate, registry = controller(1)
    first = item("first", "a")
    await ctl.acquire(first)  # room: dispatched at once
    order = []

    async def run(it):
        await ctl.acquire(it)
        order.append(it.req_id)

    low = [asyncio.create_task(run(item(f"low{i}", "a"))) for i in range(2)]
    await asyncio.sleep(0)
    high = asyncio.create_task(run(item("high", "b", band=10)))
    await asyncio.sleep(0.01)
    assert ctl.num_queued == 3 and order == []
    ctl.release(first, 10)
    await asyncio.sleep(0.01)
    assert order == ["high"]  # came last, went first
    gate.slots = 3  # capacity returns without a release: the tick dispatches the rest in order
    await asyncio.wait_for(asyncio.gather(high, *low), 2.0)
    assert order == ["high", "low0", "low1"]
    assert counts(registry) == {("0", "a", "dispatched"): 3.0, ("10", "b", "dispatched"): 1.0}


@pytest.mark.asyncio
async def test_sheddable_is_answered_503_at_once_while_band_0_waits():
    ctl, gate, registry = controller(1, max_queue_wait_s=5)
    running = item("r")
    await ctl.acquire(running)
    waiter = asyncio.create_task(ctl.acquire(item("b0", "t")))
    await asyncio.sleep(0.01)
    with pytest.raises(APIError) as exc:
        await ctl.acquire(item("s", "t", band=-1))
    assert exc.value.status == 503 and exc.value.headers()["Retry-After"] == "1"
    assert exc.value.code == "sheddable_shed" and ctl.num_queued == 1
    ctl.release(running, 0)
    await waiter  # band 0 got the slot, no 503
    assert counts(registry) == {("0", "a", "dispatched"): 1.0, ("-1", "t", "shed"): 1.0, ("0", "t", "dispatched"): 1.0}


@pytest.mark.asyncio
async def test_time_in_queue_bound_is_503_with_retry_after():
    ctl, gate, registry = controller(0, max_queue_wait_s=0.05, retry_after_s=3)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(APIError) as exc:
        await ctl.acquire(item("x"))
    waited = loop.time() - t0
    assert exc.value.status == 503 and exc.value.code == "queue_timeout"
    assert exc.value.headers()["Retry-After"] == "3"
    assert 0.04 <= waited < 2.0 and ctl.num_queued == 0
    assert counts(registry) == {("0", "a", "shed"): 1.0}


@pytest.mark.asyncio
async def test_full_queue_429_for_the_flow_over_its_share_503_otherwise():
    ctl, gate, registry = controller(0, max_queued_per_band=4)
    alone = [asyncio.create_task(ctl.acquire(item(f"s{i}", "solo"))) for i in range(4)]
    await asyncio.sleep(0.01)
    with pytest.raises(APIError) as exc:  # one flow holds the queue: saturation, not a share
        await ctl.acquire(item("s4", "solo"))
    assert exc.value.status == 503 and exc.value.code == "queue_full"
    for task in alone:
        task.cancel()
    await asyncio.gather(*alone, return_exceptions=True)

    flood = [asyncio.create_task(ctl.acquire(item(f"a{i}", "a"))) for i in range(3)]
    b = asyncio.create_task(ctl.acquire(item("b0", "b")))
    await asyncio.sleep(0.01)
    with pytest.raises(APIError) as exc:  # a holds 3 of 4: over its share, its own request is refused
        await ctl.acquire(item("a3", "a"))
    assert exc.value.status == 429 and exc.value.code == "flow_share_exceeded"
    assert exc.value.headers()["Retry-After"] == "1"
    c0 = asyncio.create_task(ctl.acquire(item("c0", "c")))  # c is under: a's newest makes room
    await asyncio.sleep(0.01)
    with pytest.raises(APIError) as evicted:
        await flood[2]
    assert evicted.value.status == 429 and queue_length(registry, band=0) == 4
    with pytest.raises(APIError) as again:  # a, c both at 2 of 5 with the newcomer: c's own is refused
        await ctl.acquire(item("c1", "c"))
    assert again.value.status == 429
    for task in [*flood[:2], b, c0]:
        task.cancel()
    await asyncio.gather(*flood[:2], b, c0, return_exceptions=True)
    assert ctl.num_queued == 0
    got = counts(registry)
    assert sum(got.values()) == 12  # every request once, whatever its outcome
    assert got[("0", "a", "rejected")] == 2 and got[("0", "c", "rejected")] == 1
    assert got[("0", "solo", "shed")] == 1 and got[("0", "solo", "cancelled")] == 4


@pytest.mark.asyncio
async def test_client_gone_leaves_the_queue_at_once():
    ctl, gate, registry = controller(0)
    task = asyncio.create_task(ctl.acquire(item("x")))
    await asyncio.sleep(0.01)
    assert ctl.num_queued == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert ctl.num_queued == 0 and ctl.bands[0].flows == {}
    assert counts(registry) == {("0", "a", "cancelled"): 1.0}
    gate.slots = 1
    await ctl.acquire(item("y"))  # the slot the cancelled one never took is free
    assert ctl.num_dispatched == 1


@pytest.mark.asyncio
async def test_dispatched_as_the_client_left_gives_the_room_back():
    ctl, gate, registry = controller(1)
    running = item("r")
    await ctl.acquire(running)
    task = asyncio.create_task(ctl.acquire(item("x")))
    await asyncio.sleep(0.01)
    ctl.release(running, 0)  # x dispatched: its future is set, the task not yet resumed
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert ctl.num_dispatched == 0
    await ctl.close()


@pytest.mark.asyncio
async def test_tick_dispatches_when_capacity_returns_without_a_release():
    ctl, gate, registry = controller(0)
    task = asyncio.create_task(ctl.acquire(item("x")))
    await asyncio.sleep(0.01)
    gate.slots = 1  # a worker came up (a load report): no release happens
    await asyncio.wait_for(task, 2.0)
    assert ctl.num_dispatched == 1


def test_router_and_up_flags_reach_the_config():
    import argparse

    from splitserve.router.main import add_router_args, config_from_args

    parser = argparse.ArgumentParser()
    add_router_args(parser)
    args = parser.parse_args(
        [
            "--flow-control",
            "--flow-objective",
            "chat=10",
            "--flow-objective",
            "batch=-1",
            "--flow-max-running",
            "4",
            "--flow-reserved-running",
            "1",
            "--flow-max-wait",
            "5",
            "--flow-max-queued",
            "9",
        ]
    )
    flow = config_from_args(args).flow_control
    assert flow.enabled and flow.objectives == {"chat": 10, "batch": -1}
    assert (flow.max_running_per_worker, flow.reserved_running, flow.max_queue_wait_s, flow.max_queued_per_band) == (
        4,
        1,
        5.0,
        9,
    )
    assert not config_from_args(parser.parse_args([])).flow_control.enabled
    with pytest.raises(SystemExit):
        parser.parse_args(["--flow-objective", "chat"])
    with pytest.raises(ConfigError, match="reserved_running"):
        config_from_args(parser.parse_args(["--flow-control", "--flow-reserved-running", "2"]))
