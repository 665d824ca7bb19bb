"""vLLM's `return_token_ids` extension (router/api/schemas.py): with it every choice, and every stream
chunk, carries the generated token ids beside the text, so a client (the chaos soak) can compare
answers exactly; without it the responses stay OpenAI's. A real gateway in front of a fake
worker that speaks the real gRPC (routerkit)."""

import json

import httpx
import pytest
from routerkit import FakeWorker, RouterServer, router_config

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def gateway(loop, tokenizer):
    worker = loop.run(FakeWorker(tokenizer=tokenizer).start())
    server = RouterServer(loop, router_config([worker.address]), tokenizer=tokenizer).start(num_decode=1)
    yield server
    server.stop()
    loop.run(worker.stop())


def stream_events(gateway, body):
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_token_ids_come_with_the_text_and_only_when_asked(gateway, tokenizer, path):
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "Hello there"}]} if "chat" in path else {"prompt": "Hello"})
    plain = httpx.post(gateway.url + path, json=body, timeout=60).json()["choices"][0]
    assert "token_ids" not in plain
    choice = httpx.post(gateway.url + path, json={**body, "return_token_ids": True}, timeout=60).json()["choices"][0]
    text = choice["message"]["content"] if "chat" in path else choice["text"]
    assert len(choice["token_ids"]) == 6 and all(isinstance(t, int) for t in choice["token_ids"])
    assert tokenizer.decode(choice["token_ids"]) == text


def test_streamed_token_ids_add_up_to_the_whole_answers(gateway):
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": "Hello there"}]}
    whole = httpx.post(
        gateway.url + "/v1/chat/completions", json={**body, "return_token_ids": True}, timeout=60
    ).json()["choices"][0]["token_ids"]
    events = stream_events(gateway, {**body, "stream": True, "return_token_ids": True})
    assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == whole
    assert all("token_ids" not in c for e in stream_events(gateway, {**body, "stream": True}) for c in e["choices"])
