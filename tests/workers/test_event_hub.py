"""EventHub, the fan-out behind WatchEvents: what a (re)subscribing router gets first."""

import asyncio

from splitserve.platform.kv.block_pool import BlockStored
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.workers.events import EventHub


async def first_messages(hub: EventHub, n: int) -> list[pb.WorkerEvent]:
    out = []
    async for msg in hub.subscribe():
        out.append(msg)
        if len(out) == n:
            return out


def test_subscription_starts_with_snapshot_and_latest_load():
    async def main():
        hub = EventHub(asyncio.get_running_loop(), pb.WorkerInfo(worker_id="w1", role="decode"))
        hub.publish([BlockStored(block_hashes=[b"a" * 32, b"b" * 32], parent_hash=None)])
        await asyncio.sleep(0)  # publish hops through call_soon_threadsafe
        hub.send_load(pb.LoadReport(num_running=3, kv_usage=0.25))
        msgs = await asyncio.wait_for(first_messages(hub, 4), 5)
        assert [m.WhichOneof("payload") for m in msgs] == ["info", "kv", "kv", "load"]
        assert msgs[1].kv.WhichOneof("event") == "cleared"
        assert list(msgs[2].kv.stored.block_hashes) == [b"a" * 32, b"b" * 32]
        # The router scores an unknown load as neutral, which can cancel a full prefix hit; the
        # latest report comes with the snapshot so a resubscription never leaves it unknown.
        assert msgs[3].load.num_running == 3 and abs(msgs[3].load.kv_usage - 0.25) < 1e-6
        assert [m.seq for m in msgs] == sorted(m.seq for m in msgs)

    asyncio.run(main())


def test_subscription_before_any_load_report_has_none():
    async def main():
        hub = EventHub(asyncio.get_running_loop(), pb.WorkerInfo(worker_id="w1", role="decode"))
        gen = hub.subscribe()
        kinds = [(await gen.__anext__()).WhichOneof("payload") for _ in range(2)]
        hub.send_load(pb.LoadReport(num_waiting=1))
        live = await asyncio.wait_for(gen.__anext__(), 5)
        await gen.aclose()
        assert kinds == ["info", "kv"] and live.WhichOneof("payload") == "load" and live.load.num_waiting == 1

    asyncio.run(main())


def test_snapshot_carries_the_second_tier_separately():
    """A block evicted into the second tier leaves the cache's snapshot and joins the tier-2 one,
    so a resubscribing router still knows this worker can serve the prefix (from tier 2)."""
    from splitserve.platform.kv.block_pool import TIER_SECOND, BlockRemoved

    async def main():
        hub = EventHub(asyncio.get_running_loop(), pb.WorkerInfo(worker_id="w1", role="both"))
        a, b = b"a" * 16, b"b" * 16
        hub.publish([BlockStored((a, b), None), BlockRemoved((b,)), BlockStored((b,), None, tier=TIER_SECOND)])
        await asyncio.sleep(0)
        msgs = await asyncio.wait_for(first_messages(hub, 4), 5)
        assert [(list(m.kv.stored.block_hashes), m.kv.stored.tier) for m in msgs[2:]] == [([a], 0), ([b], 2)]

    asyncio.run(main())
