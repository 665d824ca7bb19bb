"""Two router replicas sharing one prefix index in a real Redis (started by the test suite)
reach the same prefix hit rate as one router, on real workers.

Workload: groups of requests sharing a 320-token prefix (20 blocks) with distinct 24-token
suffixes. Each group is a burst, all in flight together, alternating between the replicas: the
followers are sent 200 ms after the first request (time for its router to publish where it went)
and 50 ms apart, while the first request is still being served (each takes over a second), so
their placement rests on the index (speculative entries and KV events). Prefill is local
(disaggregation `never`), and a follower that reaches the first request's decode worker reuses
the prefix even if it arrives while that prefix is still being computed (the scheduler holds it
back a step rather than compute the prefix twice), so the hit rate measures placement alone. Hit rate = cached prompt tokens / prompt tokens, as the decode
workers report them. (That one replica sees the other's speculative entries is asserted
directly in test_router_index.py.)"""

import concurrent.futures
import dataclasses
import time

import httpx
import pytest
from routerkit import RouterServer, router_config
from workerproc import ROUTER_STALE_AFTER_S, security

from splitserve.platform.hashing import BlockHasher
from splitserve.router.config import DisaggregationConfig, IndexConfig, PlacementConfig

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
NUM_GROUPS, GROUP_SIZE = 4, 4


def ids(n, salt):
    return [(i * 7919 + salt * 104729) % 40000 + 100 for i in range(n)]


def run_workload(urls, salt):
    """Send the bursts; returns (cached tokens, prompt tokens, decode worker per group member)."""
    cached = total = 0
    placements = []
    with httpx.Client(timeout=120) as client, concurrent.futures.ThreadPoolExecutor(GROUP_SIZE) as pool:
        for group in range(NUM_GROUPS):
            prefix = ids(320, salt * 1000 + group)
            futures = []
            for k in range(GROUP_SIZE):
                body = {
                    "model": MODEL,
                    "prompt": prefix + ids(24, salt * 1000 + 500 + group * 10 + k),
                    "max_tokens": 2,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                futures.append(pool.submit(client.post, f"{urls[k % len(urls)]}/v1/completions", json=body))
                time.sleep(0.2 if k == 0 else 0.05)
            responses = [f.result() for f in futures]
            for r in responses:
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                total += usage["prompt_tokens"]
            placements.append([r.headers["x-splitserve-decode-worker"] for r in responses])
    return cached, total, placements


def test_two_replicas_on_redis_match_one_router(cluster, loop, tokenizer, redis_server):
    redis_server.flush()
    local = dataclasses.replace(
        router_config([w.address for w in cluster], tls=security().tls, stale_after_s=ROUTER_STALE_AFTER_S),
        placement=PlacementConfig(disaggregation=DisaggregationConfig(mode="never")),
    )
    redis_index = IndexConfig(backend="redis", redis_url=redis_server.url, key_prefix="replicas")
    replicas = [
        RouterServer(loop, dataclasses.replace(local, index=redis_index), tokenizer=tokenizer).start(2, 2)
        for _ in range(2)
    ]
    single = RouterServer(loop, local, tokenizer=tokenizer).start(2, 2)
    unshared = [RouterServer(loop, local, tokenizer=tokenizer).start(2, 2) for _ in range(2)]
    try:
        one_cached, one_total, one_places = run_workload([single.url], salt=31)
        two_cached, two_total, two_places = run_workload([r.url for r in replicas], salt=32)
        # Both replicas see the same index (one view in Redis): the last group's prefix is held
        # whole by the worker(s) that served it. (Checked now: later traffic may evict it.)
        last_prefix = BlockHasher(MODEL, 16).hash_blocks(ids(320, 32 * 1000 + NUM_GROUPS - 1))
        addresses = [w.address for w in cluster]
        views = [loop.run(r.router.index.match(addresses, last_prefix)) for r in replicas]
        assert views[0] == views[1] and max(views[0].values()) == 20, views
        apart_cached, apart_total, _ = run_workload([r.url for r in unshared], salt=33)
        one_rate, two_rate = one_cached / one_total, two_cached / two_total
        # For comparison only (not asserted: it depends on timing): replicas with separate
        # in-memory indexes, which learn of each other's placements only through KV events.
        print(
            f"prefix hit rate: one router {one_rate:.3f}, two replicas on Redis {two_rate:.3f}, "
            f"two replicas with separate indexes {apart_cached / apart_total:.3f}"
        )
        assert one_rate > 0.5, one_places
        assert two_rate >= one_rate - 0.05, (one_rate, two_rate, one_places, two_places)
    finally:
        for server in replicas + [single] + unshared:
            server.stop()
