"""Admin scope and closed-by-default surfaces of the gateway (issue 42), through a real
`splitserve router` app on a socket with routerkit's FakeWorker (the real Worker gRPC protocol,
a fake engine) and the official `openai` client:

* runtime LoRA load/unload need a key with role admin; `lora_path` must lie under
  `gateway.lora_roots` (403 otherwise, `..` resolved first); with keys and no roots they are off;
* /metrics, /openapi.json and /docs need a key when keys are configured, unless made public;
  /metrics (every tenant's usage) an admin or metrics key, and a metrics key calls nothing else;
* a model outside a key's scope is a 404 that names only the key's models; /v1/models lists those;
* `chat_template_kwargs` naming `messages` or `add_generation_prompt` is a 400, not a 500;
* a key given as a plain `--api-key` is counted under its own label, not as "anonymous".
"""

from __future__ import annotations

import hashlib

import httpx
import openai
import pytest
from routerkit import FakeWorker, RouterServer, router_config

from splitserve.platform.errors import ConfigError
from splitserve.router.config import ApiKey, GatewayConfig
from splitserve.router.config.keys import parse_keys

MODEL = "smollm2-135m"
ADMIN, USER, PLAIN, SCRAPER, SCOPED = "sk-admin", "sk-user", "sk-plain", "sk-scraper", "sk-scoped"


def adapter_folder(path) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    return str(path)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora")
    return {
        "root": str(base / "allowed"),
        "inside": adapter_folder(base / "allowed" / "chat"),
        "outside": adapter_folder(base / "elsewhere" / "evil"),
    }


@pytest.fixture(scope="module")
def stack(loop, tokenizer, roots):
    worker = loop.run(FakeWorker(tokenizer=tokenizer).start())
    keys = (
        ApiKey(ADMIN, "ops", role="admin"),
        ApiKey(USER, "team"),
        ApiKey(PLAIN),  # as --api-key makes it
        ApiKey(SCRAPER, "prometheus", role="metrics"),
        ApiKey(SCOPED, "scoped", models=(MODEL,)),
    )
    server = RouterServer(
        loop,
        router_config([worker.address], gateway=GatewayConfig(api_keys=keys, lora_roots=(roots["root"],))),
        tokenizer=tokenizer,
    ).start(num_decode=1)
    yield server
    server.stop()
    loop.run(worker.stop())


def post(server, path: str, key: str | None, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def get(server, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server.url + path, headers=headers, timeout=30)


def test_lora_load_and_unload_need_an_admin_key(stack, roots):
    body = {"lora_name": "chat", "lora_path": roots["inside"]}
    for key in (USER, PLAIN):
        r = post(stack, "/v1/load_lora_adapter", key, body)
        assert r.status_code == 403 and "role admin" in r.json()["error"]["message"], r.text
        r = post(stack, "/v1/unload_lora_adapter", key, {"lora_name": "chat"})
        assert r.status_code == 403
    assert post(stack, "/v1/load_lora_adapter", None, body).status_code == 401
    assert post(stack, "/v1/load_lora_adapter", ADMIN, body).status_code == 200
    assert post(stack, "/v1/unload_lora_adapter", ADMIN, {"lora_name": "chat"}).status_code == 200


@pytest.mark.parametrize("where", ["outside", "traversal", "etc"])
def test_lora_paths_outside_the_roots_are_refused(stack, roots, where):
    path = {"outside": roots["outside"], "traversal": roots["root"] + "/../elsewhere/evil", "etc": "/etc"}[where]
    r = post(stack, "/v1/load_lora_adapter", ADMIN, {"lora_name": "evil", "lora_path": path})
    assert r.status_code == 403, r.text
    assert r.json()["error"]["param"] == "lora_path" and "outside the allowed folders" in r.json()["error"]["message"]


def test_without_roots_a_keyed_gateway_loads_nothing(loop, tokenizer, roots):
    worker = loop.run(FakeWorker(tokenizer=tokenizer).start())
    server = RouterServer(
        loop,
        router_config([worker.address], gateway=GatewayConfig(api_keys=(ApiKey(ADMIN, "ops", role="admin"),))),
        tokenizer=tokenizer,
    ).start(num_decode=1)
    try:
        r = post(server, "/v1/load_lora_adapter", ADMIN, {"lora_name": "chat", "lora_path": roots["inside"]})
        assert r.status_code == 403 and "--lora-roots" in r.json()["error"]["message"]
    finally:
        server.stop()
        loop.run(worker.stop())


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_docs_follow_the_apis_auth(stack, path):
    assert get(stack, path).status_code == 401
    assert get(stack, path, USER).status_code == 200
    assert get(stack, "/health").status_code == 200  # liveness stays open for probes


def test_metrics_need_an_admin_or_metrics_key_which_calls_nothing_else(stack):
    assert get(stack, "/metrics").status_code == 401
    denied = get(stack, "/metrics", USER)
    assert denied.status_code == 403 and "role admin or metrics" in denied.json()["error"]["message"]
    assert get(stack, "/metrics", ADMIN).status_code == 200
    assert "splitserve_key_requests_total" in get(stack, "/metrics", SCRAPER).text
    scraper = openai.OpenAI(base_url=stack.url + "/v1", api_key=SCRAPER, max_retries=0, timeout=30)
    with pytest.raises(openai.PermissionDeniedError, match="may read /metrics only"):
        scraper.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_a_scoped_key_sees_only_its_models_in_the_list_and_in_a_404(stack, roots):
    assert post(
        stack, "/v1/load_lora_adapter", ADMIN, {"lora_name": "secret-x", "lora_path": roots["inside"]}
    ).is_success
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key=SCOPED, max_retries=0, timeout=30)
        assert [m.id for m in client.models.list()] == [MODEL]
        for model in ("secret-x", "no-such-model"):
            with pytest.raises(openai.NotFoundError) as exc:
                client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert "secret-x" not in str(exc.value) or model == "secret-x"
            assert "serves" not in str(exc.value)  # the scope's 404: it names nothing else
        user = openai.OpenAI(base_url=stack.url + "/v1", api_key=USER, max_retries=0, timeout=30)
        assert "secret-x" in [m.id for m in user.models.list()]
    finally:
        post(stack, "/v1/unload_lora_adapter", ADMIN, {"lora_name": "secret-x"})


def test_metrics_and_docs_can_be_made_public(loop, tokenizer):
    worker = loop.run(FakeWorker(tokenizer=tokenizer).start())
    gateway = GatewayConfig(api_keys=(ApiKey(USER, "team"),), public_metrics=True, public_docs=True)
    server = RouterServer(loop, router_config([worker.address], gateway=gateway), tokenizer=tokenizer)
    server.start(num_decode=1)
    try:
        for path in ("/metrics", "/openapi.json", "/docs"):
            assert get(server, path).status_code == 200, path
        assert "/v1/chat/completions" in get(server, "/openapi.json").json()["paths"]
        assert get(server, "/v1/models").status_code == 401  # the API itself still needs its key
    finally:
        server.stop()
        loop.run(worker.stop())


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"add_generation_prompt": False}])
def test_reserved_chat_template_kwargs_are_a_400(stack, kwargs):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=USER, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"chat_template_kwargs": kwargs},
        )
    assert f"chat_template_kwargs may not set {next(iter(kwargs))}" in str(exc.value)
    r = post(
        stack,
        "/tokenize",
        USER,
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs},
    )
    assert r.status_code == 400 and "chat_template_kwargs may not set" in r.json()["error"]["message"]


def test_a_plain_api_key_is_counted_under_its_own_label(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=PLAIN, max_retries=0, timeout=30)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    metrics = get(stack, "/metrics", ADMIN).text
    label = "key-" + hashlib.sha256(PLAIN.encode()).hexdigest()[:12]
    assert f'splitserve_key_requests_total{{key_id="{label}",model="{MODEL}"}}' in metrics
    assert 'key_id="anonymous"' not in metrics


def test_key_roles_are_validated():
    [(_, admin)] = parse_keys({"keys": [{"id": "ops", "key": "k", "role": "admin"}]}, "keys.yaml")
    assert admin.role == "admin"
    with pytest.raises(ConfigError, match="role='root'"):
        parse_keys({"keys": [{"id": "ops", "key": "k", "role": "root"}]}, "keys.yaml")
    with pytest.raises(ConfigError, match="allowed: user, admin"):
        ApiKey("k", "x", role="superuser")
    with pytest.raises(ConfigError, match="need absolute folders"):
        GatewayConfig(lora_roots=("relative/dir",))
