"""The prefix index, both backends driven through the same steps: in memory, and a real
redis-server started by the test suite."""

import asyncio

import pytest

from splitserve.platform.hashing import BlockHasher
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router.placement.index import InMemoryPrefixIndex
from splitserve.router.placement.index_redis import RedisPrefixIndex

HASHER = BlockHasher("smollm2-135m", 16)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def stored(hashes):
    return pb.KVEvent(stored=pb.BlockStored(block_hashes=list(hashes)))


def removed(hashes):
    return pb.KVEvent(removed=pb.BlockRemoved(block_hashes=list(hashes)))


CLEARED = pb.KVEvent(cleared=pb.AllCleared())


@pytest.fixture(params=["memory", "redis"])
def make_index(request):
    """make(clock, ttl_s, max_blocks) -> an index of the parametrized backend (closed by the caller)."""

    def make(clock, ttl_s=10.0, max_blocks=1000):
        if request.param == "memory":
            return InMemoryPrefixIndex(ttl_s, max_blocks, clock=clock)
        redis_server = request.getfixturevalue("redis_server")
        redis_server.flush()
        return RedisPrefixIndex(redis_server.url, "test", ttl_s, max_blocks, clock=clock)

    return make


def chain(n, salt=0):
    return HASHER.hash_blocks([(i * 13 + salt) % 30000 + 3 for i in range(n * 16)])


def test_events_then_match(make_index):
    async def steps():
        index = make_index(Clock())
        h = chain(10)
        await index.apply("a", stored(h[:6]))
        await index.apply("b", stored(h[:3]))
        assert await index.match(["a", "b", "c"], h) == {"a": 6, "b": 3, "c": 0}
        await index.apply("a", removed([h[2]]))  # a hole: the match stops there
        assert (await index.match(["a"], h))["a"] == 2
        await index.apply("a", stored([h[2]]))
        assert (await index.match(["a"], h))["a"] == 6
        assert await index.num_blocks("a") == 6
        await index.apply("a", CLEARED)
        assert (await index.match(["a"], h))["a"] == 0
        await index.clear("b")
        assert await index.match(["a", "b"], h) == {"a": 0, "b": 0}
        assert await index.match(["a"], []) == {"a": 0}
        await index.close()

    asyncio.run(steps())


def test_speculative_entries_expire(make_index):
    async def steps():
        clock = Clock()
        index = make_index(clock, ttl_s=5.0)
        h = chain(4, salt=1)
        await index.add_speculative("a", h)
        assert (await index.match(["a"], h))["a"] == 4
        clock.now += 4.9
        assert (await index.match(["a"], h))["a"] == 4
        await index.apply("a", stored(h[:2]))  # confirmed by events: stays
        clock.now += 0.2
        assert (await index.match(["a"], h))["a"] == 2
        assert await index.num_blocks("a") == 2  # speculative entries are not counted
        await index.close()

    asyncio.run(steps())


def test_lru_bound_drops_least_recently_stored(make_index):
    async def steps():
        clock = Clock()
        index = make_index(clock, max_blocks=8)
        old, new = chain(6, salt=2), chain(6, salt=3)
        await index.apply("a", stored(old))
        clock.now += 1
        await index.apply("a", stored(new))
        assert await index.num_blocks("a") == 8
        assert (await index.match(["a"], new))["a"] == 6
        assert (await index.match(["a"], old))["a"] == 2  # the old chain lost its tail, kept its head
        await index.close()

    asyncio.run(steps())


def test_redis_replicas_share_one_view(redis_server):
    """Two router replicas' indexes on one Redis: what one learns (events, speculative
    entries), the other sees."""

    async def steps():
        redis_server.flush()
        clock = Clock()
        one = RedisPrefixIndex(redis_server.url, "shared", 10.0, clock=clock)
        two = RedisPrefixIndex(redis_server.url, "shared", 10.0, clock=clock)
        h = chain(5, salt=4)
        await one.add_speculative("a", h)
        assert (await two.match(["a"], h))["a"] == 5
        await two.apply("b", stored(h[:3]))
        assert (await one.match(["a", "b"], h)) == {"a": 5, "b": 3}
        await one.close()
        await two.close()

    asyncio.run(steps())


def test_second_tier_entries_count_until_removed_from_that_tier(make_index):
    """An eviction into the worker's second tier is BlockRemoved (tier 1) + BlockStored (tier 2):
    the prefix still matches that worker until the second tier drops it too."""

    async def steps():
        index = make_index(Clock())
        h = chain(6)
        await index.apply("a", stored(h))
        await index.apply("a", removed(h[3:]))
        await index.apply("a", pb.KVEvent(stored=pb.BlockStored(block_hashes=h[3:], tier=2)))
        assert await index.match(["a"], h) == {"a": 6}
        await index.apply("a", pb.KVEvent(removed=pb.BlockRemoved(block_hashes=[h[4]], tier=2)))
        assert await index.match(["a"], h) == {"a": 4}
        await index.apply("a", removed(h[:1]))  # tier 1's removal leaves tier 2's entries
        assert await index.match(["a"], h[1:]) == {"a": 3}
        await index.apply("a", CLEARED)
        assert await index.match(["a"], h) == {"a": 0}
        await index.close()

    asyncio.run(steps())
