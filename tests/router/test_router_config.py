"""The router config file: defaults, overrides, and errors that say what is allowed."""

import pytest

from splitserve.platform.errors import ConfigError
from splitserve.platform.sampling.params import SamplingParams
from splitserve.router.config import ApiKey
from splitserve.router.config.file import load_config
from splitserve.router.core.worker_messages import generate_request, sampling_params
from splitserve.router.placement.placer import Decision
from splitserve.workers import wire as worker_wire

FULL = """
model: smollm2-135m
max_model_len: 4096
gateway:
  port: 9000
  served_model_names: [smol, smollm2-135m]
  api_keys:
    - sk-plain
    - {key: sk-team, name: team, rate_per_s: 2, burst: 4}
  rate_per_s: 10
discovery:
  workers: [127.0.0.1:50051, "127.0.0.1:50052"]
index:
  backend: redis
  redis_url: redis://127.0.0.1:6379/0
  speculative_ttl_s: 3
placement:
  decode:
    scorers:
      - {name: prefix-overlap, weight: 5}
      - {name: queue-depth, weight: 1, params: {saturation: 16}}
    filter_params:
      not-saturated: {max_waiting: 8}
  disaggregation: {mode: always, min_prefill_tokens: 64}
"""


def test_full_file(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(FULL)
    config = load_config(str(path), **{"gateway.port": 9001, "gateway.host": None})
    assert config.max_model_len == 4096
    assert config.gateway.port == 9001 and config.gateway.host == "127.0.0.1"
    assert config.served_model_names == ("smol", "smollm2-135m")
    assert config.gateway.api_keys == (ApiKey("sk-plain"), ApiKey("sk-team", "team", 2, 4))
    assert config.discovery.workers == ("127.0.0.1:50051", "127.0.0.1:50052")
    assert config.index.backend == "redis" and config.index.speculative_ttl_s == 3
    decode = config.placement.decode
    assert [(s.name, s.weight, s.params) for s in decode.scorers] == [
        ("prefix-overlap", 5, {}),
        ("queue-depth", 1, {"saturation": 16}),
    ]
    assert decode.filters == ("healthy", "not-draining", "not-saturated", "balanced")
    assert decode.filter_params == {"not-saturated": {"max_waiting": 8}}
    assert config.placement.prefill.scorers[0].name == "prefix-overlap"  # default kept
    assert config.placement.disaggregation.mode == "always"


def test_defaults():
    config = load_config(None)
    assert config.model == "smollm2-135m" and config.gateway.port == 8000
    assert {s.name: s.weight for s in config.placement.decode.scorers} == {
        "prefix-overlap": 2.0,
        "queue-depth": 3.0,
        "kv-usage": 1.0,
        "cache-room": 0.5,
        "pending-assignments": 1.0,
        "lora-affinity": 2.0,
    }
    assert config.index.backend == "memory"


@pytest.mark.parametrize(
    "text,message",
    [
        ("gatway: {}", "unknown key(s) ['gatway'] in the router config; allowed: model"),
        ("gateway: {prot: 1}", "unknown key(s) ['prot'] in gateway; allowed: host, port"),
        ("index: {backend: etcd}", "index.backend='etcd'; allowed: memory, redis"),
        ("index: {backend: redis}", "needs index.redis_url"),
        ("placement: {disaggregation: {mode: sometimes}}", "allowed: conditional, always, never"),
        ("placement: {decode: {scorers: [{name: prefix-overlap, weight: -1}]}}", "weight=-1 is invalid"),
        ("discovery: {workers: [nohost]}", "worker address 'nohost' is invalid; allowed: host:port"),
        ("- a list", "must be a mapping"),
    ],
)
def test_errors_name_the_key_and_the_allowed_values(tmp_path, text, message):
    path = tmp_path / "router.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(str(path))
    assert message in str(exc.value)


def test_unknown_scorer_fails_at_startup(tmp_path):
    from splitserve.router.placement.placer import Placer
    from splitserve.router.placement.pool import WorkerPool

    path = tmp_path / "router.yaml"
    path.write_text("placement: {prefill: {scorers: [{name: prefix-overlop}]}}")
    config = load_config(str(path))
    with pytest.raises(ConfigError, match="unknown scorer 'prefix-overlop'; allowed: prefix-overlap, queue-depth"):
        Placer(config.placement, WorkerPool("m", 16), index=None)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(
            temperature=0.75,
            top_p=0.875,
            top_k=40,
            min_p=0.0625,
            repetition_penalty=1.125,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            seed=2**40,
            max_tokens=300,
            min_tokens=3,
            stop=("\n\n", "END"),
            stop_token_ids=(2, 7),
            ignore_eos=True,
            include_stop_str_in_output=True,
            logprobs=5,
            skip_special_tokens=False,
        ),
    ],
)
def test_wire_sampling_params_round_trip_through_the_workers_decoder(params):
    """router/core/worker_messages.py writes what workers/wire.py reads back, field for field (floats chosen
    exact in float32, the wire type)."""
    assert worker_wire.sampling_params(sampling_params(params)) == params


def test_generate_request_carries_the_disaggregation_decision():
    config = load_config(None).placement.disaggregation
    remote = generate_request("r1", [1, 2, 3], SamplingParams(), Decision("d", ("p1", "p2")), config)
    assert list(remote.prefill_workers) == ["p1", "p2"]
    assert remote.min_prefill_tokens == 256 and remote.disaggregation == 1  # CONDITIONAL
    local = generate_request("r2", [1, 2, 3], SamplingParams(), Decision("d"), config)
    assert list(local.prefill_workers) == [] and local.disaggregation == 3  # NEVER
    resumed = generate_request(
        "r3", [1, 2, 3], SamplingParams(), Decision("d", ("p1",)), config, resume_output_token_ids=[7, 8]
    )
    assert list(resumed.resume_output_token_ids) == [7, 8]
    assert list(resumed.prefill_workers) == [] and resumed.disaggregation == 3  # a resume prefills locally


def test_redis_password_from_the_environment_goes_into_the_url(monkeypatch):
    from splitserve.router.config.file import from_dict

    monkeypatch.setenv("REDIS_PASSWORD", "s3cr/t")
    config = from_dict({"index": {"backend": "redis", "redis_url": "redis://r:6379/0"}})
    assert config.index.redis_url == "redis://:s3cr%2Ft@r:6379/0"
    kept = from_dict({"index": {"backend": "redis", "redis_url": "redis://u:own@r:6379"}})
    assert kept.index.redis_url == "redis://u:own@r:6379"


# -- keys with limits on several gateway processes need the shared store (router/config/keys.py) ----
def _key_file(path, **limits):
    import yaml

    path.write_text(yaml.safe_dump({"keys": [{"id": "team-a", "key": "sk-a", **limits}]}))
    return str(path)


@pytest.mark.parametrize(
    "limits, num_processes, redis, refused",
    [
        ({"rpm": 10}, 2, "", True),
        ({"tpm": 1000}, 3, "", True),
        ({"monthly_tokens": 10**6}, 2, "", True),
        ({"rpm": 10}, 2, "redis://127.0.0.1:6379", False),  # counted in one store
        ({"rpm": 10}, 1, "", False),  # one process counts for itself
        ({"max_concurrent": 4}, 2, "", False),  # per process by design (docs/security.md)
    ],
)
def test_keys_with_limits_on_several_processes_need_the_shared_store(tmp_path, limits, num_processes, redis, refused):
    overrides = {
        "gateway.api_keys_file": _key_file(tmp_path / "keys.yaml", **limits),
        "gateway.num_processes": num_processes,
        "gateway.rate_limit_redis_url": redis or None,
    }
    if not refused:
        load_config(None, **overrides)
        return
    with pytest.raises(ConfigError) as err:
        load_config(None, **overrides)
    assert f"{num_processes} gateway processes (gateway.num_processes) serve keys" in str(err.value)
    assert "(team-a) without a shared quota store" in str(err.value)
    assert "Set gateway.rate_limit_redis_url" in str(err.value)
    inline = {"gateway.api_keys": [{"key": "sk-b", "rpm": 5}], "gateway.num_processes": num_processes}
    with pytest.raises(ConfigError, match=r"\(an inline key\) without a shared quota store"):
        load_config(None, **inline)


def test_num_processes_is_validated():
    with pytest.raises(ConfigError, match="gateway.num_processes=0: need a positive integer"):
        load_config(None, **{"gateway.num_processes": 0})


def test_a_key_file_that_gains_limits_at_run_time_is_refused_like_one_at_start(tmp_path, caplog):
    """The gateway re-reads its key file on change: a new file that adds limits on a multi-process
    gateway without the store is refused as a bad file is (logged; the previous keys stay)."""
    import functools

    from splitserve.router.config import GatewayConfig
    from splitserve.router.config.keys import check_shared_quotas
    from splitserve.router.errors import APIError
    from splitserve.router.tenancy.access import Authenticator

    path = tmp_path / "keys.yaml"
    _key_file(path)
    auth = Authenticator((), str(path), functools.partial(check_shared_quotas, GatewayConfig(num_processes=2)))
    assert auth.check("Bearer sk-a").name == "team-a"
    path.write_text("keys:\n- {id: team-a, key: sk-a, rpm: 10}\n- {id: team-b, key: sk-b}\n")
    assert auth.check("Bearer sk-a").rpm is None  # the keys it started with
    with pytest.raises(APIError):
        auth.check("Bearer sk-b")
    assert "without a shared quota store" in auth.key_file.reload_error
    assert caplog.text.count("was not reloaded") == 1  # read once, not again per request
