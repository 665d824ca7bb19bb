"""The admission pipeline: gates entered in order, and everything taken given back on every path."""

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter

from splitserve.router.config import ApiKey
from splitserve.router.errors import APIError
from splitserve.router.tenancy.admission import AdmissionPipeline, Slots
from splitserve.router.tenancy.concurrency import Concurrency
from splitserve.router.tenancy.quota import Quota

KEY = ApiKey("", name="team-a", rpm=100, tpm=1000, max_concurrent=2)


def pipeline(max_concurrent=1, max_queued=0):
    registry = CollectorRegistry()
    rejected = Counter("rejected", "", ["reason"], registry=registry)
    quota = Quota(registry, clock=lambda: 1_000_000.0)
    pipe = AdmissionPipeline(Concurrency(), quota, Slots(max_concurrent, max_queued), rejected)
    return pipe, quota, rejected


async def _window_tokens(quota: Quota) -> int:
    """Tokens reserved or used in the key's current quota window (the in-memory store's count)."""
    return sum(h["tok"] for h in quota.store.hashes.values())


def test_a_refused_slot_gives_back_the_quota_and_the_key_count():
    async def steps():
        pipe, quota, rejected = pipeline(max_concurrent=1, max_queued=0)
        first = await pipe.admit(KEY, "m", 300)
        assert await _window_tokens(quota) == 300
        with pytest.raises(APIError) as exc:
            await pipe.admit(KEY, "m", 200)
        assert exc.value.code == "queue_full"
        assert rejected.labels(reason="queue_full")._value.get() == 1
        assert await _window_tokens(quota) == 300  # the refused request's 200 were released
        assert pipe.gates[0].concurrency.in_flight == {"team-a": 1}
        await pipe.release(first, None)
        assert pipe.gates[0].concurrency.in_flight == {} and pipe.num_running == 0
        assert await _window_tokens(quota) == 0

    asyncio.run(steps())


def test_a_client_that_leaves_while_queued_holds_nothing():
    async def steps():
        pipe, quota, _ = pipeline(max_concurrent=1, max_queued=1)
        first = await pipe.admit(KEY, "m", 100)
        waiter = asyncio.create_task(pipe.admit(KEY, "m", 100))
        await asyncio.sleep(0.01)
        assert pipe.slots.num_queued == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert pipe.gates[0].concurrency.in_flight == {"team-a": 1}
        assert await _window_tokens(quota) == 100
        await pipe.release(first, None)
        assert pipe.gates[0].concurrency.in_flight == {} and pipe.slots.num_queued == 0

    asyncio.run(steps())


def test_release_is_once_and_in_reverse_order():
    async def steps():
        pipe, _, _ = pipeline(max_concurrent=2)
        order = []
        for gate in pipe.gates:
            leave = gate.leave

            async def traced(ticket, outcome, gate=gate, leave=leave):
                order.append(gate.reason)
                await leave(ticket, outcome)

            gate.leave = traced
        ticket = await pipe.admit(KEY, "m", 10)
        await pipe.release(ticket, None)
        await pipe.release(ticket, None)
        assert order == ["queue_full", "token_limit", "key_concurrency"]
        assert pipe.num_running == 0

    asyncio.run(steps())
