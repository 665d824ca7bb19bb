"""/v1/embeddings and echo in the router, in front of fake workers (routerkit: the real Worker gRPC):
they are placed like any request, never sent to a prefill worker (the decode worker needs the
prompt's hidden states and logits itself), and their prompt tokens count in `usage` and in the
key's tenancy records (completion tokens 0 for embeddings)."""

import base64
import json
import struct

import httpx
import pytest
from routerkit import FakeWorker, RouterServer, router_config

from splitserve.router.config import ApiKey, DisaggregationConfig, GatewayConfig, PlacementConfig

KEY = "sk-test"
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def stack(loop, tokenizer):
    decode = loop.run(FakeWorker(tokenizer=tokenizer).start())
    prefill = loop.run(FakeWorker("prefill", tokenizer=tokenizer).start())
    placement = PlacementConfig(disaggregation=DisaggregationConfig(mode="always"))
    server = RouterServer(
        loop,
        router_config(
            [decode.address, prefill.address],
            placement=placement,
            gateway=GatewayConfig(api_keys=(ApiKey(KEY, "team"),)),
        ),
        tokenizer=tokenizer,
    ).start(num_decode=1, num_prefill=1)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
        yield server, decode, http
    server.stop()
    loop.run(decode.stop())
    loop.run(prefill.stop())


def usage_rows(server, loop):
    gateway = server.server.config.app.state.gateway
    return loop.run(gateway.quota.usage_table())


def test_embeddings_are_placed_locally_and_counted(stack, loop, tokenizer):
    server, decode, http = stack
    texts = ["one short text", "and another, a little longer", "third"]
    before = {r["model"]: r for r in usage_rows(server, loop)}.get(MODEL, {"prompt_tokens": 0, "completion_tokens": 0})
    decode.requests.clear()
    answer = http.post("/v1/embeddings", json={"model": MODEL, "input": texts})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [d["embedding"] for d in body["data"]] == [[1.0, 0.0, 0.0]] * 3
    num_prompt = sum(len(tokenizer.encode(t)) for t in texts)
    assert body["usage"] == {"prompt_tokens": num_prompt, "total_tokens": num_prompt}
    assert len(decode.requests) == 3
    assert all(r.params.embed and not r.prefill_workers for r in decode.requests)
    after = {r["model"]: r for r in usage_rows(server, loop)}[MODEL]
    assert after["prompt_tokens"] - before["prompt_tokens"] == num_prompt
    assert after["completion_tokens"] == before["completion_tokens"]
    as_base64 = http.post("/v1/embeddings", json={"model": MODEL, "input": "x", "encoding_format": "base64"}).json()
    assert list(struct.unpack("<3f", base64.b64decode(as_base64["data"][0]["embedding"]))) == [1.0, 0.0, 0.0]


def test_echo_is_prefilled_by_the_decode_worker_but_plain_requests_use_the_prefill_worker(stack):
    server, decode, http = stack
    decode.requests.clear()
    prompt = "A prompt long enough to be worth a remote prefill " * 4
    plain = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    echo = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    )
    assert plain.status_code == echo.status_code == 200
    assert decode.requests[0].prefill_workers and not decode.requests[1].prefill_workers
    assert decode.requests[1].params.prompt_logprobs == 1 and decode.requests[1].params.max_tokens == 1
    choice = echo.json()["choices"][0]
    assert choice["text"] == prompt and echo.json()["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == [-1.0] * (len(choice["logprobs"]["tokens"]) - 1)


def test_streamed_echo_sends_the_prompt_and_its_logprobs_first(stack):
    server, decode, http = stack
    prompt = "Score this prompt"
    chunks = []
    with http.stream(
        "POST",
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True},
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :])["choices"][0])
    assert chunks[0]["text"].startswith(prompt)
    first = chunks[0]["logprobs"]
    assert first["token_logprobs"][0] is None and first["top_logprobs"][0] is None
    num_prompt = len(first["tokens"]) - 1  # the prompt's tokens, then the first generated one
    assert first["token_logprobs"][1:num_prompt] == [-1.0] * (num_prompt - 1)
    assert all(not c["text"].startswith(prompt) for c in chunks[1:])
    assert "".join(c["text"] for c in chunks).startswith(prompt) and chunks[-1]["finish_reason"] == "length"
