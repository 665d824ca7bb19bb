"""Placement against real worker processes (two decode, two prefill; the SmolLM2 model):
requests sharing a long prefix land where it is cached — shown by the router's index and by
the workers' own cached-token counts — a much deeper queue outweighs the prefix hit, and a
prefix no worker holds goes to the emptier prefix cache (cache-room, from the load reports)."""

import asyncio
import threading
import time

import httpx
import pytest
from routerkit import RouterServer, router_config
from workerproc import ROUTER_STALE_AFTER_S, security, worker_channel

from splitserve.platform.hashing import BlockHasher
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
HASHER = BlockHasher(MODEL, 16)


def ids(n, salt):
    return [(i * 7919 + salt * 104729) % 40000 + 100 for i in range(n)]


@pytest.fixture(scope="module")
def gateway(cluster, loop, tokenizer):
    server = RouterServer(
        loop,
        router_config([w.address for w in cluster], tls=security().tls, stale_after_s=ROUTER_STALE_AFTER_S),
        tokenizer=tokenizer,
    )
    server.start(num_decode=2, num_prefill=2, timeout=60)
    client = httpx.Client(base_url=server.url, timeout=120)
    yield server, client
    client.close()
    server.stop()


def test_the_cluster_is_secured(cluster):
    """The shared cluster runs as `splitserve up` does: a plaintext client is refused in the
    handshake by every worker, the suite's client certificate is served."""
    import grpc

    async def first_event(make_channel):
        async with make_channel() as ch:
            async for msg in pb_grpc.WorkerStub(ch).WatchEvents(pb.WatchEventsRequest(), timeout=30):
                return msg

    for w in cluster:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(first_event(lambda w=w: grpc.aio.insecure_channel(w.address)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert asyncio.run(first_event(lambda w=w: worker_channel(w.address))).info.role == w.role
    assert all("--kv-secret-file" in w.args and "--tls-ca" in w.args for w in cluster)


def complete(client, prompt, max_tokens=2):
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return r


def wait_for_index(loop, server, address, hashes, expected, timeout=10):
    deadline = time.monotonic() + timeout
    while True:
        matched = loop.run(server.router.index.match([address], hashes))[address]
        if matched >= expected or time.monotonic() > deadline:
            return matched
        time.sleep(0.05)


def test_shared_prefix_lands_where_it_is_cached(gateway, cluster, loop):
    server, client = gateway
    prefix = ids(600, salt=1)
    blocks = HASHER.hash_blocks(prefix)  # 37 full blocks
    first = complete(client, prefix + ids(20, salt=100))
    home = first.headers["x-splitserve-decode-worker"]
    prefill = first.headers.get("x-splitserve-prefill-worker")
    assert prefill, "620 uncached tokens >= 256: the prompt should have been prefilled remotely"
    decode_addresses = [w.address for w in cluster if w.role == "decode"]
    other = next(a for a in decode_addresses if a != home)
    assert wait_for_index(loop, server, home, blocks, len(blocks)) == len(blocks)
    assert wait_for_index(loop, server, prefill, blocks, len(blocks)) == len(blocks)
    assert loop.run(server.router.index.match([other], blocks))[other] == 0
    for salt in (101, 102, 103):
        r = complete(client, prefix + ids(20, salt=salt))
        assert r.headers["x-splitserve-decode-worker"] == home
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == 620
        assert usage["prompt_tokens_details"]["cached_tokens"] >= len(blocks) * 16  # the worker's own count
        assert "x-splitserve-prefill-worker" not in r.headers  # only 20-odd uncached tokens: local prefill


def test_much_deeper_queue_outweighs_the_prefix_hit(gateway, cluster, loop):
    server, client = gateway
    prefix = ids(600, salt=2)
    first = complete(client, prefix + ids(20, salt=200))
    home = first.headers["x-splitserve-decode-worker"]
    prefill_home = first.headers["x-splitserve-prefill-worker"]
    busy = Background(home, num_requests=8)
    try:
        deadline = time.monotonic() + 60
        while True:
            load = loop.call(lambda: server.router.pool.workers[home].load)
            if load is not None and load.num_running + load.num_waiting >= 8:
                break
            assert time.monotonic() < deadline, f"the background requests did not show up in {home}'s load"
            time.sleep(0.1)
        r = complete(client, prefix + ids(20, salt=201))
        assert r.headers["x-splitserve-decode-worker"] != home
        # The other decode worker lacks the prefix, so it is prefilled remotely — on the prefill
        # worker that caches it.
        assert r.headers["x-splitserve-prefill-worker"] == prefill_home
    finally:
        busy.stop()


def test_a_new_prefix_goes_to_the_emptier_cache_and_a_held_one_to_its_holder(gateway, cluster, loop):
    """cache-room on real load reports (`num_cached_blocks`): between two idle decode workers,
    a prefix neither holds goes to the one whose prefix cache holds fewer blocks; a prefix the
    fuller one holds still goes there."""
    server, client = gateway
    decode = [w.address for w in cluster if w.role == "decode"]

    def report(address):
        load = loop.call(lambda: server.router.pool.workers[address].load)
        assert load is not None, f"no load report from {address}"
        return load

    def wait_for(what, predicate, timeout=60):
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"{what} within {timeout} s"
            time.sleep(0.1)

    fuller = max(decode, key=lambda a: report(a).num_cached_blocks)
    emptier = next(a for a in decode if a != fuller)

    def gap():
        return report(fuller).num_cached_blocks - report(emptier).num_cached_blocks

    def idle():
        return all(report(a).num_running + report(a).num_waiting == 0 and report(a).kv_usage == 0 for a in decode)

    group = ids(600, salt=3)  # 37 full blocks no worker holds yet
    for tokens in [group] + [ids(1600, salt=salt) for salt in range(30, 34)]:  # then up to 4 x 100 blocks
        loop.run(compute_on(fuller, tokens))
        if gap() >= 150:
            break
    wait_for("the router seeing 150 more cached blocks on one worker", lambda: gap() >= 150)
    wait_for("both decode workers idle", idle)
    r = complete(client, ids(600, salt=4) + ids(20, salt=400))
    assert r.headers["x-splitserve-decode-worker"] == emptier, (report(fuller), report(emptier))
    wait_for("both decode workers idle", idle)
    r = complete(client, group + ids(20, salt=300))
    assert r.headers["x-splitserve-decode-worker"] == fuller
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 37 * 16


async def compute_on(address, tokens):
    """One prompt prefilled on the worker itself (no remote prefill), one token out."""
    async with worker_channel(address) as ch:
        request = pb.GenerateRequest(
            request_id=f"fill-{time.monotonic_ns()}",
            prompt_token_ids=tokens,
            params=pb.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
            disaggregation=pb.DISAGGREGATION_MODE_NEVER,
        )
        async for _ in pb_grpc.WorkerStub(ch).Generate(request):
            pass


class Background:
    """Long generations sent straight to one worker over gRPC, until stop()."""

    def __init__(self, address, num_requests):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tasks = [asyncio.run_coroutine_threadsafe(self._one(address, i), self.loop) for i in range(num_requests)]

    async def _one(self, address, i):
        async with worker_channel(address) as ch:
            request = pb.GenerateRequest(
                request_id=f"busy-{i}-{time.monotonic_ns()}",
                prompt_token_ids=ids(20, 900 + i),
                params=pb.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
            )
            async for _ in pb_grpc.WorkerStub(ch).Generate(request):
                pass

    def stop(self):
        for task in self.tasks:
            task.cancel()
        time.sleep(0.5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


PD_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["id", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}], ids=["greedy", "seeded"])
def test_constrained_output_is_the_same_prefilled_remotely_or_locally(gateway, sampling):
    """The prefill worker samples the first token under the request's grammar and the decode
    worker continues the same matcher: the P/D answer parses, validates and equals the answer
    of the same request prefilled locally (its second run, whose prompt is then cached)."""
    import json

    import jsonschema

    _, client = gateway
    body = {
        "model": MODEL,
        "prompt": ids(400, salt=17 + len(sampling)),
        "max_tokens": 80,
        "structured_outputs": {"json": PD_SCHEMA},
        **sampling,
    }
    remote = client.post("/v1/completions", json=body)
    assert remote.status_code == 200, remote.text
    assert remote.headers.get("x-splitserve-prefill-worker"), "400 uncached tokens: prefilled remotely"
    local = client.post("/v1/completions", json=body)
    assert (
        "x-splitserve-prefill-worker" not in local.headers
        and local.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    )
    text = remote.json()["choices"][0]["text"]
    assert remote.json()["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), PD_SCHEMA)
    assert local.json()["choices"][0]["text"] == text
