"""Flow control inside the request pipeline (router/core/pipeline.py): the queue between admission
and dispatch, the flow item settled to the tokens used when the run closes, and a queued request
whose client leaves. Admission, quota, slots and the flow controller are the real ones; the
dispatcher is test_router_pipeline's scripted stand-in and the workers are the detector's view of
them (plain objects with a load report), as in test_flow_units."""

from __future__ import annotations

import asyncio

import pytest
from otlp_receiver import OtlpReceiver
from prometheus_client import CollectorRegistry, Counter
from test_flow_units import Clock, Worker
from test_router_pipeline import ScriptedDispatcher, chunk, prepared

from splitserve.platform.observability import tracing
from splitserve.router.config import ApiKey
from splitserve.router.config.flow import FlowControlConfig
from splitserve.router.core.pipeline import Origin, Pipeline
from splitserve.router.errors import APIError
from splitserve.router.flow.controller import FlowController
from splitserve.router.flow.saturation import SaturationDetector
from splitserve.router.tenancy.admission import AdmissionPipeline, Slots
from splitserve.router.tenancy.concurrency import Concurrency
from splitserve.router.tenancy.quota import Quota

KEY = ApiKey("", name="team-a", priority=0, max_priority=10, weight=2.0)


class RecordingController(FlowController):
    """The real controller; it also records each release (the item and the tokens it settles to)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.released: list[tuple[str, int | None]] = []

    def release(self, item, used_tokens):
        self.released.append((item.req_id, used_tokens))
        super().release(item, used_tokens)


def setup(script, worker: Worker):
    registry = CollectorRegistry()
    admission = AdmissionPipeline(
        Concurrency(),
        Quota(registry, clock=lambda: 1_000_000.0),
        Slots(8, 0),
        Counter("rejected", "", ["reason"], registry=registry),
    )
    clock = Clock()
    config = FlowControlConfig(
        enabled=True, objectives={"chat": 10, "batch": -1}, max_running_per_worker=1, max_queue_wait_s=30
    )
    flow = RecordingController(config, SaturationDetector(config, lambda: [worker], clock), clock=clock)
    dispatcher = ScriptedDispatcher(script)
    return Pipeline(admission, dispatcher, flow), admission, flow, dispatcher


def origin(headers=None, gone: asyncio.Event | None = None) -> Origin:
    gone = gone or asyncio.Event()
    return Origin(headers or {}, "10.0.0.1", gone.wait)


def test_the_flow_item_is_settled_once_to_the_tokens_the_run_used():
    async def steps():
        script = {"r-0": [chunk([1, 2], completion=2), chunk([3], completion=3, finish="stop")]}
        pipeline, admission, flow, _ = setup(script, Worker())
        run = await pipeline.open(
            KEY, "m", prepared(n_choices=1), origin=origin({"x-gateway-inference-objective": "chat"})
        )
        assert flow.num_dispatched == 1 and run.prepared.jobs[0].band == 10  # the band goes to the worker
        [item async for item in run]
        await run.close()
        await run.close()
        assert flow.released == [("r", 10 + 3)]  # prompt + completion, not the reserved 10 + 50
        assert flow.num_dispatched == 0 and admission.num_running == 0

    asyncio.run(steps())


def test_a_request_without_an_origin_passes_admission_only():
    async def steps():
        pipeline, admission, flow, _ = setup(
            {"r-0": [chunk([1], completion=1, finish="stop")]}, Worker(num_inflight=1)
        )  # saturated: a queued request would wait
        async with await pipeline.open(KEY, "m", prepared(n_choices=1)) as run:
            [item async for item in run]
        assert flow.num_dispatched == 0 and flow.released == [] and admission.num_running == 0

    asyncio.run(steps())


def test_a_queued_request_whose_client_leaves_is_gone_at_once_and_holds_nothing():
    async def steps():
        worker = Worker(num_inflight=1)  # the cap of 1 is taken: requests queue
        pipeline, admission, flow, dispatcher = setup({"r-0": []}, worker)
        gone = asyncio.Event()
        task = asyncio.create_task(pipeline.open(KEY, "m", prepared(n_choices=1), origin=origin(gone=gone)))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if flow.num_queued:
                break
        assert flow.num_queued == 1 and admission.num_running == 0  # queued before admission: holds no slot
        gone.set()
        with pytest.raises(APIError) as err:
            await asyncio.wait_for(task, 5)
        assert err.value.status == 499
        assert flow.num_queued == 0 and flow.num_dispatched == 0 and flow.released == []
        assert admission.num_running == 0 and dispatcher.closed == []  # it never reached a worker
        await flow.close()

    asyncio.run(steps())


def test_flow_controls_refusal_gives_the_admission_back():
    async def steps():
        pipeline, admission, flow, _ = setup({"r-0": []}, Worker(num_inflight=1))
        with pytest.raises(APIError) as err:
            await pipeline.open(
                KEY, "m", prepared(n_choices=1), origin=origin({"x-gateway-inference-objective": "batch"})
            )
        assert err.value.status == 503 and err.value.code == "sheddable_shed"
        with pytest.raises(APIError) as err:
            await pipeline.open(
                KEY, "m", prepared(n_choices=1), origin=origin({"x-gateway-inference-objective": "nope"})
            )
        assert err.value.status == 400
        assert admission.num_running == 0 and flow.num_queued == 0

    asyncio.run(steps())


def test_the_queue_wait_is_a_gateway_flow_span_before_admission():
    """Exported over real OTLP gRPC to tests/otlp_receiver.py, as in tests/platform/test_tracing.py."""
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with OtlpReceiver() as receiver:
        tracer = tracing.OtelTracer(tracing.TracingConfig(role="router", endpoint=receiver.endpoint, sample_ratio=1.0))

        async def steps():
            root = tracer.start("gateway.request", {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
            tokens = tracing.enter(root)
            try:
                pipeline, _, _, _ = setup({"r-0": [chunk([1], completion=1, finish="stop")]}, Worker())
                headers = {"x-gateway-inference-objective": "chat", "x-gateway-inference-fairness-id": "team-x"}
                async with await pipeline.open(KEY, "m", prepared(n_choices=1), origin=origin(headers)) as run:
                    [item async for item in run]
            finally:
                tracing.leave(tokens)
                root.end()

        asyncio.run(steps())
        tracer.shutdown()
        spans = {s.name: s for s in receiver.wait_for(trace_id, {"gateway.admission", "gateway.flow"})}
    assert spans["gateway.flow"].parent_id == spans["gateway.admission"].parent_id == spans["gateway.request"].span_id
    assert spans["gateway.flow"].attributes == {
        "splitserve.flow.band": 10,
        "splitserve.flow.id": "team-a",  # the key's flow: the header names a sub-flow under it
        "splitserve.flow.sub_flow": "team-x",
        "splitserve.flow.queued": False,
    }
    assert spans["gateway.admission"].start_s >= spans["gateway.flow"].start_s  # flow control comes first
