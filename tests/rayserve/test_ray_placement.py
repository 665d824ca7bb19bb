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


def start_local_ray(tmp_path_factory, attempts: int = 2) -> None:
    """ray.init on 2 CPUs; once more when Ray's head times out starting its raylet (the start-up flake
    raykit.start_local_serve also retries: Ray failing to start on a loaded machine, not this code)."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")))
            return
        except Exception as exc:  # noqa: BLE001 - only the start-up timeout is retried
            ray.shutdown()
            if "timed out during startup" not in str(exc) or attempt == attempts:
                raise


def test_serve_places_a_tp_2_replica_in_its_bundles(tmp_path_factory):
    """A local Ray: the probe replica runs in a placement group of the two rendered bundles, STRICT_PACK, and
    a task in bundle 1 runs on the replica's node."""
    import ray
    from ray import serve

    rendered = options({"threads": 1}, {"tensor_parallel_size": 2, "ray_actor_options": {"num_cpus": 1}})

    @serve.deployment
    class Probe:
        def report(self) -> dict:
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

    keys = ("ray_actor_options", "placement_group_bundles", "placement_group_strategy")
    start_local_ray(tmp_path_factory)
    try:
        handle = serve.run(Probe.options(**{k: rendered[k] for k in keys}).bind(), name="probe", route_prefix=None)
        report = handle.report.remote().result(timeout_s=120)
    finally:
        serve.shutdown()
        ray.shutdown()
    assert report == {"bundles": [{"CPU": 1.0}, {"CPU": 1.0}], "strategy": "STRICT_PACK", "same_node": True}


def test_claim_bundle_gpus_needs_the_placement_group(monkeypatch):
    """Outside a placement group (a replica deployed without the rendered options) the claim fails clearly."""
    import ray.util.placement_group as pg

    monkeypatch.setattr(pg, "get_current_placement_group", lambda: None)
    with pytest.raises(RuntimeError, match="tensor_parallel_size 2 needs the replica's placement group"):
        placement.claim_bundle_gpus(2)
