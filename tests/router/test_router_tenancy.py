"""Keys as data (router/tenancy/): the key file, its reload, model scopes, per-key request and
token windows and monthly budgets, in memory (a fake clock) and in a real Redis."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import yaml
from prometheus_client import CollectorRegistry

from splitserve.router.config import ApiKey, ConfigError
from splitserve.router.config.file import load_config
from splitserve.router.config.keys import digest, parse_keys
from splitserve.router.errors import APIError
from splitserve.router.tenancy.access import Authenticator
from splitserve.router.tenancy.keyfile import KeyFile
from splitserve.router.tenancy.quota import Quota
from splitserve.router.usage import Usage


def write_keys(path, keys) -> None:
    """Replace the file the way a Secret volume does: a new file renamed over the old one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump({"keys": keys}, f)
    os.replace(tmp, path)


def test_key_file_hashes_scopes_and_reloads(tmp_path):
    path = str(tmp_path / "keys.yaml")
    write_keys(
        path, [{"id": "team-a", "sha256": digest("sk-a"), "models": ["m"], "tpm": 100}, {"id": "team-b", "key": "sk-b"}]
    )
    assert "sk-a" not in open(path).read()
    auth = Authenticator((ApiKey("sk-flag", "flag"),), path)
    a = auth.check("Bearer sk-a")
    assert (a.name, a.models, a.tpm, a.rpm, a.key) == ("team-a", ("m",), 100, None, "")
    assert auth.check("Bearer sk-b").name == "team-b"
    assert auth.check("Bearer sk-flag").name == "flag"  # --api-key keeps working
    with pytest.raises(APIError) as exc:
        auth.check("Bearer sk-c")
    assert exc.value.status == 401
    write_keys(path, [{"id": "team-c", "key": "sk-c", "rpm": 5}])  # rotated: no restart
    assert auth.check("Bearer sk-c").rpm == 5
    with pytest.raises(APIError):
        auth.check("Bearer sk-a")
    with open(path, "w") as f:  # a broken edit keeps the last good keys
        f.write("keys: [{id: x}]\n")
    assert auth.check("Bearer sk-c").name == "team-c"
    assert "exactly one of sha256" in auth.key_file.reload_error


@pytest.mark.parametrize(
    "data,message",
    [
        ([], "need a mapping with a list `keys:`"),
        ({"keys": [{"id": "a"}]}, "exactly one of sha256"),
        ({"keys": [{"id": "a", "key": "k", "sha256": "0" * 64}]}, "exactly one of sha256"),
        ({"keys": [{"id": "a", "sha256": "xyz"}]}, "need 64 hex digits"),
        ({"keys": [{"id": "a:b", "key": "k"}]}, "need an id of 1-64 letters"),
        ({"keys": [{"id": "a", "key": "k"}, {"id": "a", "key": "l"}]}, "unique in the file"),
        ({"keys": [{"id": "a", "key": "k", "tpm": 0}]}, "tpm=0: need a positive integer"),
        ({"keys": [{"id": "a", "key": "k", "models": "m"}]}, "models: need a list"),
        ({"keys": [{"id": "a", "key": "k", "budget": 1}]}, "fields from"),
    ],
)
def test_bad_key_files_say_what_is_wrong(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_keys(data, "keys.yaml")


def test_missing_key_file_and_bad_window_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="api_keys_file"):
        KeyFile(str(tmp_path / "absent.yaml"))
    with pytest.raises(ConfigError, match="quota_window_s"):
        load_config(None, **{"gateway.quota_window_s": 0})


class Clock:
    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _finish(quota, grant, prompt, completion):
    return quota.settle(grant, Usage(prompt_tokens=prompt, completion_tokens=completion))


def _limits(quota: Quota, key: ApiKey, clock: Clock):
    async def steps():
        g1 = await quota.admit(key, "m", 60)  # reserves prompt + max_tokens
        assert g1.headers["x-ratelimit-remaining-tokens"] == "40"
        assert g1.headers["x-ratelimit-remaining-requests"] == "2"
        with pytest.raises(APIError) as exc:
            await quota.admit(key, "m", 41)
        assert exc.value.status == 429 and exc.value.code == "rate_limit_exceeded"
        assert "x-ratelimit-remaining-tokens" in exc.value.headers() and "Retry-After" in exc.value.headers()
        await _finish(quota, g1, 10, 5)  # used 15 of 60: 45 come back
        assert g1.headers["x-ratelimit-remaining-tokens"] == "85"
        g2 = await quota.admit(key, "m", 85)
        await quota.release(g2)  # never ran: everything comes back
        g3 = await quota.admit(key, "m", 1)
        assert g3.headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(APIError, match="3 requests per 60 s"):
            await quota.admit(key, "m", 1)
        await _finish(quota, g3, 1, 0)
        clock.t += 60  # next window (memory store's clock)
        with pytest.raises(APIError, match="request too large"):
            await quota.admit(key, "m", 101)

    return steps()


def test_memory_quota_reserves_settles_and_resets():
    clock = Clock()
    quota = Quota(CollectorRegistry(), clock=clock)
    key = ApiKey("", "team-a", rpm=3, tpm=100)
    asyncio.run(_limits(quota, key, clock))
    ok = asyncio.run(quota.admit(key, "m", 100))
    assert ok.headers["x-ratelimit-remaining-tokens"] == "0"


def test_monthly_budget_and_usage_table():
    clock = Clock()
    quota = Quota(CollectorRegistry(), clock=clock)
    key = ApiKey("", "team-b", monthly_tokens=50)

    async def steps():
        g = await quota.admit(key, "m", 40)
        with pytest.raises(APIError) as exc:
            await quota.admit(key, "m", 20)
        assert exc.value.code == "insufficient_quota" and exc.value.status == 429
        await _finish(quota, g, 20, 10)
        await _finish(quota, await quota.admit(key, "m", 20), 15, 5)
        return await quota.usage_table()

    rows = asyncio.run(steps())
    month = rows[0]["period"]
    assert rows == [
        {
            "period": month,
            "key_id": "team-b",
            "model": "m",
            "requests": 2,
            "prompt_tokens": 35,
            "cached_tokens": 0,
            "completion_tokens": 15,
        }
    ]


def test_out_of_scope_model_is_404():
    quota = Quota(CollectorRegistry())
    with pytest.raises(APIError) as exc:
        asyncio.run(quota.admit(ApiKey("", "a", models=("m",)), "other", 1))
    assert exc.value.status == 404 and exc.value.code == "model_not_found"


def test_redis_quota_is_shared_between_replicas(redis_server):
    redis_server.flush()
    key = ApiKey("", "team-r", rpm=3, tpm=100)

    async def steps():
        one = Quota(CollectorRegistry(), redis_server.url, "t", window_s=86400)  # no window ends mid-test
        two = Quota(CollectorRegistry(), redis_server.url, "t", window_s=86400)
        try:
            g1 = await one.admit(key, "m", 60)
            with pytest.raises(APIError):
                await two.admit(key, "m", 41)  # the other replica sees the reservation
            await _finish(one, g1, 10, 5)
            g2 = await two.admit(key, "m", 85)
            assert g2.headers["x-ratelimit-remaining-tokens"] == "0"
            assert g2.headers["x-ratelimit-remaining-requests"] == "1"
            await _finish(two, g2, 80, 5)
            return await one.usage_table()
        finally:
            await one.close()
            await two.close()

    rows = asyncio.run(steps())
    assert [(r["key_id"], r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [
        ("team-r", 2, 90, 10)
    ]


def test_concurrent_requests_per_key_are_bounded(loop, tokenizer, tmp_path):
    """One key with max_concurrent 1 against a FakeWorker (routerkit; real gRPC): a second request
    while a stream runs gets 429, another key is unaffected, and the slot comes back at the end."""
    import httpx
    from routerkit import FakeWorker, RouterServer, router_config

    from splitserve.router.config import GatewayConfig

    path = tmp_path / "keys.yaml"
    write_keys(str(path), [{"id": "one", "key": "sk-one", "max_concurrent": 1}, {"id": "two", "key": "sk-two"}])
    worker = loop.run(FakeWorker(tokenizer=tokenizer, token_delay_s=0.05).start())
    server = RouterServer(
        loop, router_config([worker.address], gateway=GatewayConfig(api_keys_file=str(path))), tokenizer=tokenizer
    ).start()
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            one, two = {"Authorization": "Bearer sk-one"}, {"Authorization": "Bearer sk-two"}
            with c.stream(
                "POST", "/v1/chat/completions", headers=one, json={**body, "max_tokens": 30, "stream": True}
            ) as r:
                lines = r.iter_lines()
                next(lines)
                busy = c.post("/v1/chat/completions", headers=one, json=body)
                assert busy.status_code == 429 and busy.json()["error"]["code"] == "too_many_concurrent_requests"
                assert c.post("/v1/chat/completions", headers=two, json=body).status_code == 200
                list(lines)
            deadline = time.monotonic() + 10  # the slot is freed as the response ends, just after its last byte
            while (status := c.post("/v1/chat/completions", headers=one, json=body).status_code) == 429:
                assert time.monotonic() < deadline, "the key's slot never came back"
                time.sleep(0.05)
            assert status == 200
    finally:
        server.stop()
        loop.run(worker.stop())


def test_oversized_headers_get_431(loop, tokenizer):
    import httpx
    from routerkit import RouterServer, router_config

    server = RouterServer(loop, router_config([]), tokenizer=tokenizer).start(num_decode=0)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.get("/v1/models", headers={"x-padding": "a" * 20000})
            assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"
            assert c.get("/v1/models").status_code == 200
    finally:
        server.stop()


def test_an_unreachable_store_never_fails_a_request(caplog):
    """Redis down (the chaos soak restarts it): admission goes on without limits, settling and
    usage are skipped, each miss is logged and counted (fail open, docs/security.md)."""
    from ports import free_port

    port = free_port()  # a port nothing listens on
    registry = CollectorRegistry()
    quota = Quota(registry, redis_url=f"redis://127.0.0.1:{port}/0")
    key = ApiKey("", "team-c", rpm=1, tpm=10)

    async def steps():
        grants = [await quota.admit(key, "m", 5) for _ in range(3)]  # rpm=1, yet all three pass
        for g in grants:
            await _finish(quota, g, 3, 2)
        await quota.close()
        return grants

    with caplog.at_level("WARNING"):
        grants = asyncio.run(steps())
    assert len(grants) == 3 and all(g.window_key in (None, "") for g in grants)
    assert registry.get_sample_value("splitserve_router_quota_store_errors_total", {"op": "admit"}) == 3
    assert registry.get_sample_value("splitserve_router_quota_store_errors_total", {"op": "usage"}) == 3
    assert (
        registry.get_sample_value(
            "splitserve_key_tokens_total", {"key_id": "team-c", "model": "m", "kind": "completion"}
        )
        == 6
    )
    assert "quota store unreachable during admit" in caplog.text
