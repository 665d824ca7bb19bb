"""Scale from zero (router/core/hold.py): a request that finds no decode worker is held until one
appears, within a bounded queue and a timeout, then 503 with Retry-After; the held count is a gauge."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from splitserve.platform.errors import ConfigError
from splitserve.router.config import GatewayConfig
from splitserve.router.core.hold import ColdStartHold
from splitserve.router.errors import NoWorkerError
from splitserve.router.metrics import RouterMetrics


async def _until(cond, timeout=30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_held_request_proceeds_when_a_worker_appears_and_the_gauge_counts_it():
    metrics = RouterMetrics()
    hold = ColdStartHold(timeout_s=60.0, max_held=4, gauge=metrics.held, poll_s=0.01)
    workers = []
    waiters = [asyncio.create_task(hold.wait(lambda: bool(workers))) for _ in range(3)]
    await _until(lambda: hold.num_held == 3)
    assert b"splitserve_router_held_requests 3.0" in generate_latest(metrics.registry)
    workers.append("decode-1")  # the scaler brought a worker up
    await asyncio.gather(*waiters)
    assert hold.num_held == 0
    assert b"splitserve_router_held_requests 0.0" in generate_latest(metrics.registry)


@pytest.mark.asyncio
async def test_full_hold_queue_and_timeout_give_503_with_retry_after():
    hold = ColdStartHold(timeout_s=0.2, max_held=1, poll_s=0.01)
    first = asyncio.create_task(hold.wait(lambda: False))
    await _until(lambda: hold.num_held == 1)
    with pytest.raises(NoWorkerError, match="already wait") as full:
        await hold.wait(lambda: False)
    assert full.value.status == 503 and full.value.retry_after_s
    with pytest.raises(NoWorkerError, match="no decode worker became ready within 0.2 s") as late:
        await first
    assert late.value.status == 503 and late.value.retry_after_s
    assert hold.num_held == 0


@pytest.mark.asyncio
async def test_hold_off_or_worker_present_returns_at_once():
    await ColdStartHold(timeout_s=0.0, max_held=4).wait(lambda: False)  # off: placement answers 503 itself
    await ColdStartHold(timeout_s=60.0, max_held=0).wait(lambda: True)


def test_bad_hold_settings_are_rejected():
    with pytest.raises(ConfigError, match="cold_start_hold_s=-1"):
        GatewayConfig(cold_start_hold_s=-1)


def test_demand_tokens_are_counted_for_the_planner():
    metrics = RouterMetrics()
    metrics.count_tokens(1500, 1, True)
    metrics.count_tokens(0, 3, False)
    assert (metrics.num_uncached_prompt_tokens, metrics.num_output_tokens, metrics.num_planned_requests) == (1500, 4, 1)
    text = generate_latest(metrics.registry).decode()
    assert 'splitserve_router_demand_tokens_total{kind="uncached_prompt"} 1500.0' in text
    assert 'splitserve_router_demand_tokens_total{kind="output"} 4.0' in text
