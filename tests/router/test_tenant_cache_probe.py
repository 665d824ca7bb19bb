"""The cached_tokens probe (issue 53): team-a guesses team-b's prompt and reads how many tokens hit
the shared prefix cache. With keys, the gateway reports a hit only as far as the asking key sent
the prefix itself (router/tenancy/prefix_owners.py). A real router app on a socket, the official
`openai` client, and routerkit's FakeWorker, whose prefix cache reports real hits by block hash."""

from __future__ import annotations

import openai
import pytest
from routerkit import FakeWorker, RouterServer, router_config

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
