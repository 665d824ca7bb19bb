"""API keys, token-bucket rate limits (in memory and in a real Redis) and admission."""

import asyncio

import pytest

from splitserve.router.config import ApiKey, GatewayConfig
from splitserve.router.errors import APIError
from splitserve.router.tenancy.access import Authenticator, MemoryBuckets, RateLimiter, RedisBuckets, key_label
from splitserve.router.tenancy.admission import Slots


@pytest.mark.parametrize(
    "header,ok",
    [
        ("Bearer sk-one", True),
        ("bearer sk-two", True),
        ("Bearer  sk-one ", True),
        (None, False),
        ("", False),
        ("Bearer sk-wrong", False),
        ("Basic sk-one", False),
        ("sk-one", False),
    ],
)
def test_api_keys(header, ok):
    auth = Authenticator((ApiKey("sk-one", "one"), ApiKey("sk-two")))
    if ok:
        assert auth.check(header).key in ("sk-one", "sk-two")
    else:
        with pytest.raises(APIError) as exc:
            auth.check(header)
        assert exc.value.status == 401 and exc.value.code == "invalid_api_key"


def test_no_keys_configured_means_open():
    assert Authenticator(()).check(None).name == "anonymous"


def test_labels_never_show_the_key():
    assert key_label(ApiKey("sk-secret", "team")) == "team"
    assert "sk-secret" not in key_label(ApiKey("sk-secret"))


def test_memory_bucket_refills_at_the_rate():
    now = [0.0]
    buckets = MemoryBuckets(clock=lambda: now[0])

    async def steps():
        assert [await buckets.take("k", 2.0, 3) for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst
        assert await buckets.take("k", 2.0, 3) == pytest.approx(0.5)  # 1 token / 2 per s
        now[0] += 0.5
        assert await buckets.take("k", 2.0, 3) == 0.0
        assert await buckets.take("other", 2.0, 3) == 0.0  # per identity
        now[0] += 100
        assert [await buckets.take("k", 2.0, 3) for _ in range(4)][-1] > 0  # capped at burst

    asyncio.run(steps())


def test_redis_bucket_is_shared(redis_server):
    async def steps():
        redis_server.flush()
        one, two = RedisBuckets(redis_server.url, "t"), RedisBuckets(redis_server.url, "t")
        assert await one.take("k", 1.0, 2) == 0.0
        assert await two.take("k", 1.0, 2) == 0.0
        wait = await one.take("k", 1.0, 2)
        assert 0.9 < wait <= 1.0
        await asyncio.sleep(wait + 0.05)
        assert await two.take("k", 1.0, 2) == 0.0
        await one.close()
        await two.close()

    asyncio.run(steps())


def test_rate_limiter_uses_per_key_overrides():
    limiter = RateLimiter(GatewayConfig(rate_per_s=100.0, burst=100))

    async def steps():
        slow = ApiKey("sk-slow", "slow", rate_per_s=0.5, burst=1)
        await limiter.check(slow)
        with pytest.raises(APIError) as exc:
            await limiter.check(slow)
        assert exc.value.status == 429 and exc.value.headers() == {"Retry-After": "2"}
        for _ in range(50):
            await limiter.check(ApiKey("sk-fast", "fast"))

    asyncio.run(steps())


def test_admission_queue_bounds():
    async def steps():
        admission = Slots(max_concurrent=1, max_queued=1)
        await admission.acquire()
        waiter = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0.01)
        assert admission.num_queued == 1
        with pytest.raises(APIError) as exc:
            await admission.acquire()
        assert exc.value.status == 429 and exc.value.code == "queue_full"
        admission.release()
        await waiter
        assert admission.num_running == 1 and admission.num_queued == 0
        admission.release()

    asyncio.run(steps())
