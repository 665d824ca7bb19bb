"""`splitserve serve` without a cluster: the config file's validation (table-driven), the CLI's
errors, the rendered Serve config (checked against Ray Serve's own schema), the deploy/ray/
examples, and the small pieces — the queue-depth policy, the registry, RayDiscovery — on plain
objects."""

import asyncio
import dataclasses
import pathlib
import types

import pytest
import yaml

from splitserve.platform.cli import main
from splitserve.platform.errors import ConfigError
from splitserve.rayserve import config as ray_config
from splitserve.rayserve.autoscale import QUEUE_DEPTH, queue_depth_policy
from splitserve.rayserve.discovery import RayDiscovery
from splitserve.rayserve.registry import WorkerRegistry

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"backend": "kubernetes"}, "backend='kubernetes' is not supported by `splitserve serve`; allowed: ray"),
        ({"bogus": 1}, "unknown key(s) ['bogus'] in the config; allowed: backend, name"),
        (
            {"decode": {"min_replicas": 3, "max_replicas": 2}},
            "decode.max_replicas=2 is below decode.min_replicas=3; allowed: max_replicas >= min_replicas",
        ),
        ({"prefill": {"min_replicas": 0}}, "prefill.min_replicas=0"),
        ({"decode": {"target_queue_depth": 0}}, "decode.target_queue_depth=0 must be > 0"),
        ({"decode": {"replicas": 2}}, "unknown key(s) ['replicas'] in decode; allowed: min_replicas, max_replicas"),
        (
            {"decode": {"ray_actor_options": {"num_cpu": 1}}},
            "unknown key(s) ['num_cpu'] in decode.ray_actor_options; allowed: num_cpus, num_gpus",
        ),
        ({"kv_transport": "rdma"}, "kv_transport='rdma' is not supported; allowed: ucx, tcp"),
        ({"engine": {"dtype": "int3"}}, "dtype='int3' is not supported; allowed:"),
        ({"engine": {"grpc_port": 1}}, "engine: ['grpc_port'] are decided by the config's own keys"),
        ({"router": {"gateway": {"prot": 1}}}, "unknown key(s) ['prot'] in gateway"),
        ({"autoscaling": {"look_back_period_s": 1, "metrics_interval_s": 2}}, "need 0 < metrics_interval_s"),
        ({"ray": {"num_cpus": 0}}, "ray.num_cpus=0 must be >= 1"),
        ({"decode": [1, 2]}, "decode must be a mapping, got list"),
        (
            {"ray": {"address": "auto"}},
            "security: on a Ray cluster (ray.address 'auto') name tls_cert, tls_key, tls_ca and kv_secret_file",
        ),
        ({"security": {"tls_cert": "/c"}}, "security: tls_cert, tls_key and tls_ca go together"),
        ({"security": {"insecure": "yes"}}, "security.insecure='yes' must be true or false"),
        ({"security": {"tls": 1}}, "unknown key(s) ['tls'] in security; allowed: tls_cert"),
        ({"otlp_traces_sample_ratio": 2.0}, "trace sample ratio 2.0 is invalid; allowed: 0.0 to 1.0"),
    ],
)
def test_bad_config_says_what_is_wrong_and_what_is_allowed(data, message):
    with pytest.raises(ConfigError) as err:
        ray_config.parse(data)
    assert message in str(err.value)


def write(tmp_path, data) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_cli_exits_2_with_the_reason(tmp_path, capsys):
    path = write(tmp_path, {"decode": {"min_replicas": 2, "max_replicas": 1}})
    assert main(["serve", "--backend", "ray", "--config", path]) == 2
    assert "decode.max_replicas=1 is below decode.min_replicas=2" in capsys.readouterr().err
    assert main(["serve", "--backend", "slurm", "--config", path]) == 2
    assert "backend='slurm' is not supported by `splitserve serve`; allowed: ray" in capsys.readouterr().err
    assert main(["serve", "--backend", "ray", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml does not exist" in capsys.readouterr().err


def test_gateway_defaults_to_localhost_8000_and_port_0_is_refused():
    from splitserve.rayserve.serve import RayServe

    assert ray_config.parse({}).gateway == ("127.0.0.1", 8000)
    assert RayServe(ray_config.parse({})).url == "http://127.0.0.1:8000/v1"
    with pytest.raises(ConfigError, match="needs a fixed port"):
        RayServe(ray_config.parse({"router": {"gateway": {"port": 0}}}))


def test_render_is_a_valid_serve_config_with_queue_depth_autoscaling():
    from ray.serve.schema import ServeDeploySchema

    config = ray_config.load(str(ROOT / "deploy/ray/serve.yaml"))
    rendered = ray_config.render(config)
    schema = ServeDeploySchema(**{k: v for k, v in rendered.items() if k != "proxy_location"})
    apps = {app.name: app for app in schema.applications}
    assert set(apps) == {"splitserve", "splitserve-prefill", "splitserve-decode"}
    assert apps["splitserve"].route_prefix == "/" and apps["splitserve-decode"].route_prefix is None
    [decode] = apps["splitserve-decode"].deployments
    scaling = decode.autoscaling_config
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (
        config.decode.min_replicas,
        config.decode.max_replicas,
    )
    assert scaling["policy"]["policy_function"] == "splitserve.rayserve.autoscale:queue_depth_policy"
    assert scaling["target_ongoing_requests"] == config.decode.target_queue_depth
    assert decode.ray_actor_options.num_cpus == 0.5
    assert rendered["http_options"] == {"host": "127.0.0.1", "port": 8000}


def test_print_serve_config_is_the_rendered_config(tmp_path, capsys):
    path = str(ROOT / "deploy/ray/serve.yaml")
    assert main(["serve", "--backend", "ray", "--config", path, "--print-serve-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == ray_config.render(ray_config.load(path))


def test_kuberay_rayservice_example_matches_the_cluster_config():
    """deploy/ray/rayservice.yaml embeds `--print-serve-config` of deploy/ray/cluster.yaml."""
    service = yaml.safe_load((ROOT / "deploy/ray/rayservice.yaml").read_text())
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    cluster = ray_config.load(str(ROOT / "deploy/ray/cluster.yaml"))
    assert embedded == ray_config.render(cluster), (
        "regenerate: splitserve serve --config deploy/ray/cluster.yaml --print-serve-config"
    )
    decode = cluster.decode
    assert decode.ray_actor_options.get("num_gpus") == 1 and decode.max_replicas > decode.min_replicas


def context(metrics: dict, target: int = 1, target_ongoing: float = 2.0):
    config = types.SimpleNamespace(get_target_ongoing_requests=lambda: target_ongoing)
    return types.SimpleNamespace(aggregated_metrics=metrics, target_num_replicas=target, config=config)


@pytest.mark.parametrize(
    "per_replica, desired",
    [
        ({}, 1),  # nothing reported yet: the current target stands
        ({"r1": 0.0}, 0.0),  # idle: Serve's bounds keep min_replicas
        ({"r1": 2.0}, 1.0),
        ({"r1": 7.0}, 3.5),  # Serve rounds up and caps at max_replicas
        ({"r1": 3.0, "r2": 5.0}, 4.0),
    ],
)
def test_queue_depth_policy(per_replica, desired):
    metrics = {QUEUE_DEPTH: per_replica} if per_replica else {}
    assert queue_depth_policy(context(metrics))[0] == desired


def test_registry_drops_replicas_that_stop_heartbeating():
    now = [0.0]
    registry = WorkerRegistry(stale_after_s=3.0, clock=lambda: now[0])
    registry.register({"address": "a:1", "role": "decode"})
    registry.register({"address": "b:1", "role": "prefill"})
    now[0] = 2.0
    registry.register({"address": "a:1", "role": "decode"})
    now[0] = 4.0
    assert [w["address"] for w in registry.workers()] == ["a:1"]
    registry.unregister("a:1")
    registry.register({"address": "a:1", "role": "decode"})  # a heartbeat sent before it stopped
    assert registry.workers() == []
    now[0] = 8.0
    registry.register({"address": "a:1", "role": "decode"})  # the port reused by a new replica later
    assert [w["address"] for w in registry.workers()] == ["a:1"]


def test_ray_discovery_reports_changes_and_survives_a_failed_poll():
    polls = [
        [{"address": "a:1"}],
        RuntimeError("registry restarting"),
        [{"address": "a:1"}],
        [{"address": "a:1"}, {"address": "b:1"}],
        [{"address": "b:1"}],
    ]
    seen = []

    async def fetch():
        item = polls.pop(0) if polls else [{"address": "b:1"}]
        if isinstance(item, Exception):
            raise item
        return item

    async def on_change(addresses):
        seen.append(sorted(addresses))

    async def scenario():
        task = asyncio.create_task(RayDiscovery(fetch, interval_s=0.001).run(on_change))
        while polls:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(scenario())
    assert seen == [["a:1"], ["a:1", "b:1"], ["b:1"]]


def test_deploy_configs_parse():
    for name in ("serve.yaml", "cluster.yaml"):
        config = ray_config.load(str(ROOT / "deploy/ray" / name))
        assert dataclasses.asdict(config)["backend"] == "ray"


def test_security_reaches_the_gateway_and_every_replica():
    files = {"tls_cert": "/s/tls.crt", "tls_key": "/s/tls.key", "tls_ca": "/s/ca.crt", "kv_secret_file": "/s/kv"}
    config = ray_config.parse({"ray": {"address": "auto"}, "security": files})
    rendered = ray_config.render(config)
    gateway, *pools = rendered["applications"]
    assert gateway["args"]["router"]["discovery"] == {
        "tls_cert": "/s/tls.crt",
        "tls_key": "/s/tls.key",
        "tls_ca": "/s/ca.crt",
    }
    assert [p["args"]["security"] for p in pools] == [files, files]
    insecure = ray_config.render(ray_config.parse({"ray": {"address": "auto"}, "security": {"insecure": True}}))
    assert "discovery" not in insecure["applications"][0]["args"]["router"]
    assert [p["args"]["security"] for p in insecure["applications"][1:]] == [{}, {}]
    # requests during start-up wait for a replica (router gateway.worker_wait_s), unless the config says otherwise
    assert gateway["args"]["router"]["gateway"]["worker_wait_s"] == ray_config.RAY_WORKER_WAIT_S
    mine = ray_config.parse({"router": {"gateway": {"port": 8001, "worker_wait_s": 5}}})
    assert mine.router_config().gateway.worker_wait_s == 5 and mine.gateway == ("127.0.0.1", 8001)


def test_tracing_reaches_the_gateway_and_every_replica(tmp_path):
    config = ray_config.load(
        write(tmp_path, {"otlp_traces_sample_ratio": 0.25}), otlp_traces_endpoint="http://collector:4317"
    )  # `serve --otlp-traces-endpoint`
    apps = ray_config.render(config)["applications"]  # the gateway ingress and both pools
    assert [a["args"]["tracing"] for a in apps] == [{"endpoint": "http://collector:4317", "sample_ratio": 0.25}] * 3
    traced = config.tracing("prefill")
    assert (traced.enabled, traced.name, traced.sample_ratio) == (True, "splitserve-prefill", 0.25)
    assert not ray_config.parse({}).otlp_traces_endpoint


def test_a_local_run_gets_throwaway_credentials_removed_at_stop(tmp_path):
    from splitserve.rayserve.serve import RayServe

    app = RayServe(
        dataclasses.replace(
            ray_config.load(str(ROOT / "deploy/ray/serve.yaml")),
            ray=ray_config.RayClusterConfig(temp_dir=str(tmp_path)),
        )
    )
    secured = app._with_security(app.config)
    sec = secured.security
    for path in (sec.tls_cert, sec.tls_key, sec.tls_ca, sec.kv_secret_file):
        assert pathlib.Path(path).is_file() and pathlib.Path(path).stat().st_mode & 0o077 == 0
    assert len(pathlib.Path(sec.kv_secret_file).read_text()) == 64
    assert ray_config.render(secured)["applications"][1]["args"]["security"]["kv_secret_file"] == sec.kv_secret_file
    app.stop()
    assert not pathlib.Path(sec.kv_secret_file).exists()
