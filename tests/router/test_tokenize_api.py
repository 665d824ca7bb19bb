"""/tokenize, /detokenize and /version (vLLM's shapes) over HTTP on a real gateway in front of a
fake worker (routerkit): round trips, the chat form against the chat template, special tokens,
API keys, and a clear 4xx for every bad input."""

import httpx
import pytest
from routerkit import FakeWorker, RouterServer, router_config

from splitserve.platform.__about__ import __version__
from splitserve.router.config import ApiKey, GatewayConfig

KEY = "sk-test"
MODEL = "smollm2-135m"
TEXTS = ["Hello, world!", "  leading spaces and\ttabs\nnew lines", "naïve café 日本語 🤖", "<|im_start|>user"]


@pytest.fixture(scope="module")
def client(loop, tokenizer):
    worker = loop.run(FakeWorker(tokenizer=tokenizer).start())
    server = RouterServer(
        loop, router_config([worker.address], gateway=GatewayConfig(api_keys=(ApiKey(KEY, "t"),))), tokenizer=tokenizer
    ).start(num_decode=1)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
        yield http
    server.stop()
    loop.run(worker.stop())


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_detokenize_round_trip(client, tokenizer, text):
    answer = client.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert answer["tokens"] == tokenizer.encode(text) and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] > 0 and len(answer["token_strs"]) == answer["count"]
    back = client.post("/detokenize", json={"model": MODEL, "tokens": answer["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_chat_form_is_the_chat_template(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    answer = client.post("/tokenize", json={"messages": messages}).json()
    assert answer["tokens"] == tokenizer.encode_chat(messages, True) and answer["token_strs"] is None
    without = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert without["tokens"] == tokenizer.encode_chat(messages, False)
    assert answer["count"] > without["count"]
    text = client.post("/detokenize", json={"tokens": answer["tokens"]}).json()["prompt"]
    assert text == tokenizer.apply_chat_template(messages, True)  # special tokens kept


def test_version_and_api_keys(client, tokenizer):
    assert client.get("/version").json() == {"version": __version__}
    denied = httpx.post(str(client.base_url) + "/tokenize", json={"prompt": "Hi"})
    assert denied.status_code == 401


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"prompt": "Hi", "model": "nope"}, 404, "model"),
        ("/tokenize", {"prompt": 5}, 400, None),
        ("/tokenize", {"messages": []}, 400, None),
        ("/tokenize", {"prompt": "Hi", "unknown_field": 1}, 400, None),
        ("/tokenize", {"messages": [{"role": 5, "content": "x"}]}, 400, None),
        ("/detokenize", {"tokens": [10, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_input_is_a_clear_4xx(client, path, body, status, param):
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param
