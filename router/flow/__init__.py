"""Flow control at the gateway: priority bands, fair share between tenants, dispatch held back
while the workers are saturated, sheddable traffic turned away first (GIE's flow control).

    classify.py    band and flow of a request (objective header, model default, key priority)
    fairness.py    one band's queue: per-flow queues, weighted fair queuing charged in tokens
    saturation.py  the saturation detector over the router's view of the decode workers
    latency.py     the running cap per worker from its measured step time (the default cap)
    controller.py  FlowController: acquire / release, the bounds, 503 vs 429
    metrics.py     queue length, time in queue, outcome counts per band and flow

Its settings, FlowControlConfig, are router/config/flow.py (with the router's other settings).

Torch-free and independent of FastAPI: the gateway calls `FlowController.acquire` between
admission and placement and `release` when the request ends (docs/router.md).
"""

from __future__ import annotations

from splitserve.router.config.flow import FlowControlConfig
from splitserve.router.flow.controller import FlowController
from splitserve.router.flow.metrics import FlowMetrics
from splitserve.router.flow.saturation import SaturationDetector


def build_controller(config: FlowControlConfig, pool, registry, calls=None) -> FlowController | None:
    """The gateway's controller over `pool` (router/placement/pool.py's WorkerPool), metrics in `registry`;
    None when flow control is off. With latency caps, `calls` (core/worker_calls.py's WorkerCalls)
    reports each stream's step times to the detector."""
    if not config.enabled:
        return None
    metrics = FlowMetrics(registry)
    detector = SaturationDetector(config, lambda: pool.workers.values(), pool.clock)
    if config.is_latency_capped and calls is not None:
        calls.on_step = detector.observe_step
    metrics.saturated.set_function(lambda: float(detector.is_saturated()))
    return FlowController(config, detector, metrics)
