"""A worker's LoadReport counts its prefix cache (`num_cached_blocks`: blocks under a hash, held
by a request or evictable on the free list), on a real `splitserve worker` (SmolLM2-135M, real
gRPC). The router's cache-room scorer reads it (docs/router.md); `kv_usage` and
`num_free_blocks` keep counting only blocks that requests hold.
"""

import asyncio

import pytest
from test_worker_disaggregation import generate, prompt, run
from workerproc import WorkerProc, worker_channel

from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

BS = 16
LOCAL = pb.DISAGGREGATION_MODE_NEVER


async def info_and_report(address: str, done, deadline_s: float = 30.0) -> tuple[pb.WorkerInfo, pb.LoadReport]:
    """The worker's WorkerInfo and its first load report for which `done(report)` holds; a
    failed assertion naming the last report seen when `deadline_s` passes first."""
    info, last = None, None
    try:
        async with asyncio.timeout(deadline_s), worker_channel(address) as channel:
            stream = pb_grpc.WorkerStub(channel).WatchEvents(pb.WatchEventsRequest(load_interval_s=0.05))
            async for msg in stream:
                kind = msg.WhichOneof("payload")
                if kind == "info":
                    info = msg.info
                elif kind == "load":
                    last = msg.load
                    if done(last):
                        return info, last
    except TimeoutError:
        pass
    raise AssertionError(f"no load report as wanted within {deadline_s} s; the last: {last}")


@pytest.fixture(scope="module")
def small_worker():
    # 0.05 GiB: 145 float16 blocks, so three 1,000-token prompts (62 full blocks each) must evict.
    w = WorkerProc("both", "tcp", kv_cache_gib=0.05).start()
    yield w
    w.terminate()


def test_cached_blocks_rise_with_a_served_prompt_and_stay_counted_once_it_finishes(small_worker):
    w = small_worker
    info, before = run(info_and_report(w.address, lambda r: True))
    total = info.num_total_blocks
    assert total > 0 and before.num_cached_blocks == w.kv_state()["num_cached_blocks"]

    tokens = prompt(200, salt=31)  # 12 full blocks, none cached before
    run(generate(w.address, tokens, mode=LOCAL, max_tokens=8))
    _, after = run(
        info_and_report(w.address, lambda r: r.num_running == 0 and r.num_cached_blocks > before.num_cached_blocks)
    )
    assert before.num_cached_blocks + 200 // BS <= after.num_cached_blocks <= before.num_cached_blocks + 208 // BS
    # finished: no block held, so every cached block sits evictable on the free list, still counted
    assert after.num_free_blocks == total and after.kv_usage == 0.0
    assert w.kv_state()["num_cached_blocks"] == after.num_cached_blocks

    # the same prompt again reuses its blocks: the cache does not grow by another copy
    _, last = run(generate(w.address, tokens, mode=LOCAL, max_tokens=8))
    assert last.usage.cached_tokens >= 192
    assert w.wait_idle()["num_cached_blocks"] <= after.num_cached_blocks + 1  # at most a new output block


def test_cached_blocks_stay_within_the_pool_when_prompts_evict_each_other(small_worker):
    w = small_worker
    for salt in (41, 42, 43):
        run(generate(w.address, prompt(1000, salt=salt), mode=LOCAL, max_tokens=2))
    state = w.wait_idle()
    assert state["num_free_blocks"] == state["num_blocks"]
    # the last prompt's 62 full blocks are all still cached; the first's were evicted to make room
    assert 1000 // BS <= state["num_cached_blocks"] <= state["num_blocks"]
    _, report = run(info_and_report(w.address, lambda r: r.num_cached_blocks == state["num_cached_blocks"]))
    assert report.num_running == 0 and report.num_free_blocks == state["num_blocks"]
