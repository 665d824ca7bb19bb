"""The shared channel pool: one channel per address, and channels to workers that left are closed."""

import asyncio

from splitserve.platform.wire.grpc_channels import ChannelPool


def test_one_channel_per_address_and_idle_channels_are_dropped():
    async def steps():
        now = [0.0]
        pool = ChannelPool(idle_s=300.0, clock=lambda: now[0])
        a = pool.stub("127.0.0.1:1")
        assert pool.stub("127.0.0.1:1") is a  # reused, not redialled
        now[0] = 200.0
        pool.stub("127.0.0.1:2")
        now[0] = 400.0  # :1 idle 400 s, :2 idle 200 s
        pool.stub("127.0.0.1:3")
        await asyncio.sleep(0)  # the sweep closes in a task
        assert "127.0.0.1:1" not in pool and "127.0.0.1:2" in pool and "127.0.0.1:3" in pool
        assert pool.stub("127.0.0.1:1") is not a  # a worker that comes back gets a new channel
        await pool.drop("127.0.0.1:2")
        assert "127.0.0.1:2" not in pool
        await pool.close()
        assert not any(addr in pool for addr in ("127.0.0.1:1", "127.0.0.1:3"))

    asyncio.run(steps())


def test_without_idle_limit_only_drop_forgets():
    async def steps():
        now = [0.0]
        pool = ChannelPool(clock=lambda: now[0])
        pool.stub("127.0.0.1:1")
        now[0] = 1e9
        pool.stub("127.0.0.1:2")
        await asyncio.sleep(0)
        assert "127.0.0.1:1" in pool
        await pool.close()

    asyncio.run(steps())
