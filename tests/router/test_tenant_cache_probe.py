"""The cached_tokens probe (issue 53): team-a guesses team-b's prompt and reads how many tokens hit
the shared prefix cache. With keys, the gateway reports a hit only as far as the asking key sent
the prefix itself (router/tenancy/prefix_owners.py). A real router app on a socket, the official
`openai` client, and routerkit's FakeWorker, whose prefix cache reports real hits by block hash."""

from __future__ import annotations

import time

import openai
import pytest
from routerkit import FakeWorker, RouterServer, router_config

from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router.config import ApiKey, GatewayConfig
from splitserve.router.tenancy.prefix_owners import PrefixOwners

MODEL = "smollm2-135m"
SECRET = list(range(1000, 1048))  # team-b's 48-token prefix: three blocks of 16


@pytest.fixture(scope="module")
def stack(loop, tokenizer):
    worker = loop.run(FakeWorker(tokenizer=tokenizer).start())
    keys = (ApiKey("sk-a", "team-a"), ApiKey("sk-b", "team-b"))
    server = RouterServer(
        loop, router_config([worker.address], gateway=GatewayConfig(api_keys=keys)), tokenizer=tokenizer
    )
    server.start(num_decode=1)
    yield server, worker
    server.stop()
    loop.run(worker.stop())


def cached(server, key: str, prompt: list[int]) -> int:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    return r.usage.prompt_tokens_details.cached_tokens


def test_another_tenants_prefix_is_not_reported_as_cached(stack):
    server, worker = stack
    assert cached(server, "sk-b", SECRET + [7, 8, 9]) == 0
    right, half_right = SECRET + [1, 2, 3], SECRET[:32] + [5] * 16 + [4]
    # the worker does hit team-b's blocks (32, then 48 tokens); team-a is told nothing of it
    assert cached(server, "sk-a", half_right) == 0
    assert cached(server, "sk-a", [9] * 48 + [1]) == 0  # a wrong guess: the same answer
    # the right guess hits 48 on the worker; team-a is told 32, the two blocks of its own first guess
    assert cached(server, "sk-a", right) == 32
    # its own prefix, sent again, is reported (it tells team-a only what it sent), as is team-b's own
    assert cached(server, "sk-a", right) == 48
    assert cached(server, "sk-b", SECRET + [6]) == 48


def test_prefix_owners_are_bounded_and_chain_by_prefix():
    owners = PrefixOwners(16, max_blocks=4)
    owners.record("a", [b"1", b"2", b"3"])
    assert owners.owned_tokens("a", [b"1", b"2", b"x"]) == 32
    assert owners.owned_tokens("b", [b"1", b"2"]) == 0
    owners.record("b", [b"4", b"5"])
    assert len(owners) == 4 and owners.owned_tokens("a", [b"1"]) == 0  # the least recently sent went first


# ---- a pulled prefix: x-splitserve-pulled-tokens, within the same bound ----------------------------
@pytest.fixture(scope="module")
def pair(loop, tokenizer):
    """Two colocated FakeWorkers: either may serve a request and be pulled from."""
    workers = [loop.run(FakeWorker("both", tokenizer=tokenizer).start()) for _ in range(2)]
    keys = (ApiKey("sk-a", "team-a"), ApiKey("sk-b", "team-b"))
    server = RouterServer(
        loop, router_config([w.address for w in workers], gateway=GatewayConfig(api_keys=keys)), tokenizer=tokenizer
    )
    server.start(num_decode=2)
    yield server, workers
    server.stop()
    for w in workers:
        loop.run(w.stop())


def ask(server, key: str, prompt: list[int]):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
    return raw.headers, raw.parse().usage


def fill_cache(server, loop, worker, kv_usage: float) -> None:
    """The worker reports its KV cache this full, and the router has read it."""
    worker.load = pb.LoadReport(kv_usage=kv_usage)
    deadline = time.monotonic() + 10
    while loop.call(lambda: server.router.pool.workers[worker.address].load.kv_usage) != kv_usage:
        assert time.monotonic() < deadline, "the router did not read the load report"
        time.sleep(0.05)


def test_a_pulled_prefix_is_named_only_within_what_the_key_sent(pair, loop):
    """A request placed away from the worker holding its prefix (that worker's cache is full) pulls
    the prefix from it: the response says how many prompt tokens were pulled, beside cached_tokens,
    which counts only the serving worker's own cache. A key is told of a pull only as far as it
    sent the prefix itself, as for cached_tokens: team-b learns nothing of team-a's prompt."""
    server, workers = pair
    prefix = list(range(2000, 2048))  # three blocks of 16
    headers, _ = ask(server, "sk-a", prefix + [1])
    holder = next(w for w in workers if w.address == headers["x-splitserve-decode-worker"])
    other = next(w for w in workers if w is not holder)
    fill_cache(server, loop, holder, 1.0)
    headers, usage = ask(server, "sk-a", prefix + [2])
    assert headers["x-splitserve-decode-worker"] == other.address
    assert other.requests[-1].kv_pull.holder == holder.address  # the router asked for the pull
    assert headers["x-splitserve-pulled-tokens"] == "48" and usage.prompt_tokens_details.cached_tokens == 0

    secret = list(range(3000, 3048))
    fill_cache(server, loop, holder, 0.0)
    fill_cache(server, loop, other, 1.0)
    headers, _ = ask(server, "sk-a", secret + [1])  # team-a's prompt, cached on the holder only
    assert headers["x-splitserve-decode-worker"] == holder.address
    fill_cache(server, loop, holder, 1.0)
    fill_cache(server, loop, other, 0.0)
    headers, usage = ask(server, "sk-b", secret + [2])  # team-b's guess: pulled from the holder
    assert other.requests[-1].kv_pull.num_blocks == 3
    assert "x-splitserve-pulled-tokens" not in headers and usage.prompt_tokens_details.cached_tokens == 0
    headers, usage = ask(server, "sk-a", secret + [3])  # team-a's own prefix, now on the other worker too
    assert headers["x-splitserve-decode-worker"] == other.address and usage.prompt_tokens_details.cached_tokens == 48
