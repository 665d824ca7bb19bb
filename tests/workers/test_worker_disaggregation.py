"""Prefill on one worker process, decode on another: real gRPC, real UCX (over TCP) and TCP.

Every test here runs separate `splitserve worker` processes on 127.0.0.1. The reference for
"the same answer" is the engine in the test process with the same weights.
"""

import asyncio
import time

import pytest
from workerproc import WorkerProc, worker_channel

from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

BYTES_PER_BLOCK_LAYER = 2 * 16 * 3 * 64 * 2  # K+V of one block of one layer, SmolLM2, float16 KV (auto)
NUM_LAYERS = 30


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7919 + salt * 104729) % 40000 + 100 for i in range(n)]


async def generate(
    address: str, token_ids, prefill_workers=(), mode=pb.DISAGGREGATION_MODE_ALWAYS, max_tokens=8, req_id=None, **params
):
    async with worker_channel(address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        request = pb.GenerateRequest(
            request_id=req_id or f"t-{time.monotonic_ns()}",
            prompt_token_ids=token_ids,
            params=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params),
            prefill_workers=list(prefill_workers),
            disaggregation=mode,
        )
        msgs = [m async for m in stub.Generate(request)]
    return [t for m in msgs for t in m.token_ids], msgs[-1]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module", params=["ucx", "tcp"])
def pair(request):
    d = WorkerProc("decode", request.param).start()
    p = WorkerProc("prefill", request.param).start()
    yield d, p
    for w in (d, p):
        w.terminate()


@pytest.mark.parametrize("n", [1, 15, 16, 17, 500, 1500])
def test_disaggregated_matches_colocated(pair, reference, n):
    d, p = pair
    before = d.metric('splitserve_kv_transfer_bytes_sum{direction="in"}')
    tokens, last = run(generate(d.address, prompt(n, salt=n), [p.address]))
    assert tokens == reference(prompt(n, salt=n))
    assert last.prefill_worker == p.address
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    moved = d.metric('splitserve_kv_transfer_bytes_sum{direction="in"}') - before
    assert moved == -(-n // 16) * NUM_LAYERS * BYTES_PER_BLOCK_LAYER


def test_only_missing_blocks_travel(pair, reference):
    d, p = pair
    turn1 = prompt(200, salt=77)
    turn2 = turn1 + prompt(90, salt=78)
    run(generate(d.address, turn1, mode=pb.DISAGGREGATION_MODE_NEVER))  # D caches 12 full blocks
    before = d.metric('splitserve_kv_transfer_bytes_sum{direction="in"}')
    tokens, last = run(generate(d.address, turn2, [p.address]))
    moved = d.metric('splitserve_kv_transfer_bytes_sum{direction="in"}') - before
    assert last.usage.cached_tokens == 192
    assert moved == (-(-290 // 16) - 12) * NUM_LAYERS * BYTES_PER_BLOCK_LAYER
    assert tokens == reference(turn2)


def test_conditional_mode_prefills_short_prompts_locally(pair, reference):
    d, p = pair
    before = d.metric("splitserve_remote_prefills_total")
    tokens, last = run(generate(d.address, prompt(40, salt=5), [p.address], mode=pb.DISAGGREGATION_MODE_CONDITIONAL))
    assert last.prefill_worker == ""  # 40 uncached tokens < the default threshold of 256
    assert d.metric("splitserve_remote_prefills_total") == before
    assert tokens == reference(prompt(40, salt=5))


def test_cancel_during_prefill_and_decode_frees_blocks_on_both(pair):
    d, p = pair

    async def cancel_after(delay, n, max_tokens):
        async with worker_channel(d.address) as channel:
            call = pb_grpc.WorkerStub(channel).Generate(
                pb.GenerateRequest(
                    request_id=f"cancel-{n}-{max_tokens}",
                    prompt_token_ids=prompt(n, salt=900 + n),
                    params=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                    prefill_workers=[p.address],
                    disaggregation=pb.DISAGGREGATION_MODE_ALWAYS,
                )
            )
            await asyncio.sleep(delay)
            call.cancel()

    run(cancel_after(0.3, 1500, 8))  # while the prefill worker computes
    run(cancel_after(3.0, 64, 2000))  # while the decode worker streams
    for w in (d, p):
        state = w.wait_idle()
        assert state["invariants_ok"], state
        assert state["num_free_blocks"] == state["num_blocks"], state


def test_health_ready_and_metrics_names(pair):
    d, p = pair
    run(generate(d.address, prompt(40, salt=6), [p.address]))  # one transfer, so the histograms have a sample
    for w in (d, p):
        assert w.get("/health")[0] == 200 and w.get("/ready")[0] == 200
        assert w.get("/nope")[0] == 404
    text = d.get("/metrics")[1].decode()
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert f"\n{name}{{" in text, name
    assert d.metric("splitserve_time_to_first_token_seconds_count") >= 1
    assert d.metric("splitserve_inter_token_latency_seconds_count") >= 1
    assert d.metric("splitserve_e2e_request_latency_seconds_count") >= 1
    assert d.metric('splitserve_kv_transfer_seconds_count{direction="in"}') >= 1
    assert p.metric('splitserve_kv_transfer_bytes_count{direction="out"}') >= 1


def test_prefix_cache_metrics_count_each_request_once(pair):
    """vllm:prefix_cache_queries/hits: prompt tokens looked up and found, once per request."""
    d, _ = pair
    ids = prompt(40, salt=7)
    run(generate(d.address, ids, mode=pb.DISAGGREGATION_MODE_NEVER))
    queries, hits = d.metric("vllm:prefix_cache_queries_total"), d.metric("vllm:prefix_cache_hits_total")
    _, last = run(generate(d.address, ids, mode=pb.DISAGGREGATION_MODE_NEVER))
    assert last.usage.cached_tokens == 32  # two full blocks of 40 tokens
    deadline = time.monotonic() + 10  # a scrape brings the counters up to date (test_worker_metrics_units)
    while (d.metric("vllm:prefix_cache_queries_total") - queries, d.metric("vllm:prefix_cache_hits_total") - hits) != (
        40,
        32,
    ):
        assert time.monotonic() < deadline, (
            d.metric("vllm:prefix_cache_queries_total") - queries,
            d.metric("vllm:prefix_cache_hits_total") - hits,
        )
        time.sleep(0.1)


def test_concurrent_requests_sharing_a_prompt_compute_it_once(pair, reference):
    """Two requests with one 1,500-token prefix reach the decode worker together (cold cache):
    the one that comes second waits for the first one's prefill instead of computing the same
    prefix beside it, reuses every full block, and both answers are the colocated ones."""
    d, _ = pair
    shared = prompt(1500, salt=9)
    prompts = [shared + prompt(7, salt=90), shared + prompt(7, salt=91)]
    waits = d.metric("splitserve_prefix_waits_total")

    async def both():
        return await asyncio.gather(*(generate(d.address, p, mode=pb.DISAGGREGATION_MODE_NEVER) for p in prompts))

    results = run(both())
    for p, (tokens, _) in zip(prompts, results):
        assert tokens == reference(p)
    assert sorted(last.usage.cached_tokens for _, last in results) == [0, 1488]  # the 93 whole shared blocks
    deadline = time.monotonic() + 10  # the counter follows the worker's load reports
    while d.metric("splitserve_prefix_waits_total") - waits < 1:
        assert time.monotonic() < deadline, "no prefix wait was counted"
        time.sleep(0.1)
