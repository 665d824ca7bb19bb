"""The Redis prefix index as placement sees it while Redis is unreachable (a port nobody listens
on) and when it answers (a real redis-server, routerkit.RedisServer): no store error reaches a
request (router/placement/index_resilient.py); the chaos soak restarts a live Redis (e2e/chaos.py)."""

import asyncio

from routerkit import free_port

from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router.placement.index_redis import RedisPrefixIndex
from splitserve.router.placement.index_resilient import ResilientIndex


def test_index_without_redis_places_without_prefix_hints():
    async def scenario():
        index = ResilientIndex(RedisPrefixIndex(f"redis://127.0.0.1:{free_port()}/0"))
        hashes = [b"a" * 8, b"b" * 8]
        await index.apply("w1", pb.KVEvent(stored=pb.BlockStored(block_hashes=hashes)))
        await index.add_speculative("w1", hashes)
        assert await index.match(["w1", "w2"], hashes) == {"w1": 0, "w2": 0}
        assert index.is_down and index.num_failures >= 3
        await index.clear("w1")
        await index.close()

    asyncio.run(scenario())


def test_index_recovers_when_redis_returns(redis_server):
    async def scenario():
        index = ResilientIndex(RedisPrefixIndex(redis_server.url))
        hashes = [b"c" * 8, b"d" * 8]
        await index.apply("w9", pb.KVEvent(stored=pb.BlockStored(block_hashes=hashes)))
        assert (await index.match(["w9"], hashes))["w9"] == 2 and not index.is_down
        await index.clear("w9")
        await index.close()

    asyncio.run(scenario())
