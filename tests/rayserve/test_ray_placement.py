"""Tensor-parallel replicas on Ray (rayserve/placement.py): the rendered Serve deployment options reserve one
bundle per rank in one STRICT_PACK placement group, and Ray Serve really places a replica that way.

The rendering tests run without Ray and check the options against Ray Serve's own schema. The last test
starts a local Ray (2 CPUs) and deploys a probe deployment with the rendered options of a TP 2 pool: its replica
reports the placement group Serve made for it and runs a task in its second bundle, as the engine's rank 1
would run there. It needs no engine, so it does not depend on the engine's tensor parallelism; a Ray test
serving a model at TP 2 belongs with the engine."""

from __future__ import annotations

import pytest

from splitserve.platform.errors import ConfigError
from splitserve.rayserve import config as ray_config
from splitserve.rayserve import placement


def options(engine: dict, pool: dict) -> dict:
    return ray_config.deployment_options(ray_config.parse({"engine": engine, "decode": pool}), "decode")


@pytest.mark.parametrize(
    "engine,pool,bundles",
    [
        ({"threads": 2}, {"tensor_parallel_size": 2}, [{"CPU": 2.0}, {"CPU": 2.0}]),
        (
            {"threads": 1},
            {"tensor_parallel_size": 4, "ray_actor_options": {"num_cpus": 3}},
            [{"CPU": 3.0}] + [{"CPU": 1.0}] * 3,
        ),
        (
            {"device": "cuda", "threads": 1},
            {"tensor_parallel_size": 2, "ray_actor_options": {"num_cpus": 4, "num_gpus": 1, "resources": {"h200": 1}}},
            [{"CPU": 4.0, "GPU": 1.0, "h200": 1.0}, {"CPU": 1.0, "GPU": 1.0}],
        ),
    ],
)
def test_a_tp_replica_reserves_one_bundle_per_rank_strict_pack(engine, pool, bundles):
    from ray.serve.schema import DeploymentSchema

    out = options(engine, pool)
    assert out["placement_group_bundles"] == bundles
    assert out["placement_group_strategy"] == "STRICT_PACK"
    DeploymentSchema(**out)  # Ray Serve accepts it: the actor's resources fit in the first bundle
    app = next(
        a
        for a in ray_config.render(ray_config.parse({"engine": engine, "decode": pool}))["applications"]
        if a["name"] == "splitserve-decode"
    )
    assert app["args"]["engine"]["tensor_parallel_size"] == pool["tensor_parallel_size"]  # the worker's flag


def test_tp_1_has_no_placement_group():
    out = options({}, {})
    assert "placement_group_bundles" not in out and "placement_group_strategy" not in out


@pytest.mark.parametrize(
    "engine,pool,message",
    [
        ({}, {"tensor_parallel_size": 0}, "decode.tensor_parallel_size=0; allowed: an integer from 1 to 64"),
        ({}, {"tensor_parallel_size": "2"}, "decode.tensor_parallel_size='2'; allowed: an integer from 1 to 64"),
        ({}, {"tensor_parallel_size": 65}, "decode.tensor_parallel_size=65; allowed: an integer from 1 to 64"),
        (
            {"device": "cuda"},
            {"tensor_parallel_size": 2, "ray_actor_options": {"num_gpus": 2}},
            "decode: ray_actor_options.num_gpus=2 with tensor_parallel_size 2: each rank gets a bundle with one GPU",
        ),
    ],
)
def test_bad_tp_settings_say_what_is_allowed(engine, pool, message):
    with pytest.raises(ConfigError) as err:
        ray_config.parse({"engine": engine, "decode": pool})
    assert message in str(err.value)


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """A local Ray with 2 CPUs and 2 logical GPUs (Ray hands out GPU ids 0 and 1 without any device: enough to
    check which ids a replica's bundles hold). Started once more when its head times out starting the raylet
    (Ray's start-up flake on a loaded machine, which raykit.start_local_serve retries too)."""
    import ray
    from ray import serve

    for attempt in range(1, 4):
        try:
            ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")))
            break
        except Exception as exc:  # noqa: BLE001 - only the start-up timeout is retried
            ray.shutdown()
            if "timed out during startup" not in str(exc) or attempt == 3:
                raise
    yield ray
    serve.shutdown()
    ray.shutdown()


def deploy_probe(probe_class, rendered: dict):
    """Deploy `probe_class` with the rendered placement options, return what its replica reports, remove it."""
    from ray import serve

    keys = ("ray_actor_options", "placement_group_bundles", "placement_group_strategy")
    handle = serve.run(
        serve.deployment(probe_class).options(**{k: rendered[k] for k in keys}).bind(), name="probe", route_prefix=None
    )
    try:
        return handle.report.remote().result(timeout_s=180)
    finally:
        serve.delete("probe")


def probes() -> tuple[type, type]:
    """The probe deployments, defined in a function so that Ray ships them by value (its workers cannot import
    this test module)."""

    class CpuProbe:
        def report(self) -> dict:
            import ray
            from ray.util.placement_group import get_current_placement_group, placement_group_table
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            group = get_current_placement_group()
            table = placement_group_table(group)

            @ray.remote(num_cpus=1)
            def node_of_rank() -> str:
                return ray.get_runtime_context().get_node_id()

            rank1 = node_of_rank.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, 1)).remote()
            return {
                "bundles": [dict(b) for b in table["bundles"].values()],
                "strategy": table["strategy"],
                "same_node": ray.get(rank1) == ray.get_runtime_context().get_node_id(),
            }

    class GpuProbe:
        def report(self) -> dict:
            import os

            import ray

            own = [str(i) for i in ray.get_gpu_ids()]
            visible = placement.claim_bundle_gpus(2)
            return {"own": own, "visible": visible, "env": os.environ["CUDA_VISIBLE_DEVICES"]}

    return CpuProbe, GpuProbe


def test_serve_places_a_tp_2_replica_in_its_bundles(local_ray):
    """The probe replica runs in a placement group of the two rendered bundles, STRICT_PACK, and a task in
    bundle 1 (where rank 1 runs) lands on the replica's node."""
    rendered = options({"threads": 1}, {"tensor_parallel_size": 2, "ray_actor_options": {"num_cpus": 1}})
    report = deploy_probe(probes()[0], rendered)
    assert report == {"bundles": [{"CPU": 1.0}, {"CPU": 1.0}], "strategy": "STRICT_PACK", "same_node": True}


def test_a_cuda_tp_2_replica_sees_the_gpus_of_both_bundles(local_ray):
    """Ray shows the replica only its own GPU; claim_bundle_gpus makes both bundles' GPUs visible, its own first."""
    rendered = options(
        {"device": "cuda", "threads": 1},
        {"tensor_parallel_size": 2, "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 1}},
    )
    assert rendered["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    report = deploy_probe(probes()[1], rendered)
    assert len(report["own"]) == 1
    assert report["visible"] == report["env"] and report["visible"].split(",")[0] == report["own"][0]
    assert sorted(report["visible"].split(",")) == ["0", "1"]


def test_claim_bundle_gpus_needs_the_placement_group(monkeypatch):
    """Outside a placement group (a replica deployed without the rendered options) the claim fails clearly."""
    import sys

    import ray.util.placement_group  # noqa: F401 - the module, which ray.util's function of that name hides

    monkeypatch.setattr(sys.modules["ray.util.placement_group"], "get_current_placement_group", lambda: None)
    with pytest.raises(RuntimeError, match="tensor_parallel_size 2 needs the replica's placement group"):
        placement.claim_bundle_gpus(2)
