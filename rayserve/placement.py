"""Where a tensor-parallel replica's ranks run on Ray: one placement group per replica, one bundle per rank.

A worker with `tensor_parallel_size` N is one engine whose N ranks are processes the engine starts
itself (rank 0 in the replica actor, ranks 1..N-1 as its children; platform/ docs/engine.md). Ray
Serve reserves, per replica, the bundles of `placement_group_bundles` with the strategy
`placement_group_strategy`, and schedules the replica actor in bundle 0. So:

- N bundles, one per rank: `{"CPU": threads}` on CPU (the rank's torch threads), `{"GPU": 1,
  "CPU": threads}` on CUDA;
- bundle 0 also holds the replica actor itself: each resource is the larger of the rank's and the
  actor's (`ray_actor_options`, which Serve requires to fit in the first bundle);
- STRICT_PACK: every bundle on one node, because child processes run where their parent does.

On CUDA, Ray makes only the actor's own GPU visible to it (CUDA_VISIBLE_DEVICES), so the ranks'
children would see one device. `claim_bundle_gpus` asks each other bundle which GPU it holds (a
zero-CPU task on that bundle) and makes the N GPUs visible, bundle order = rank order, before the
engine starts. TP 1 needs none of this: no placement group, the actor options alone.
"""

from __future__ import annotations

import os

from splitserve.platform.errors import ConfigError

STRATEGY = "STRICT_PACK"
# ray_actor_options keys that are resources, and the bundle resource each one is
ACTOR_RESOURCES = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}


def rank_bundle(device: str, threads: int) -> dict[str, float]:
    """What one rank reserves."""
    return {"CPU": float(threads), "GPU": 1.0} if device == "cuda" else {"CPU": float(threads)}


def actor_bundle(actor_options: dict) -> dict[str, float]:
    """The replica actor's own resources as a bundle (ray_actor_options' num_cpus, num_gpus, memory, resources)."""
    out = {res: float(actor_options[key]) for key, res in ACTOR_RESOURCES.items() if actor_options.get(key)}
    out.update({k: float(v) for k, v in (actor_options.get("resources") or {}).items()})
    return out


def bundles(tp: int, device: str, threads: int, actor_options: dict) -> list[dict[str, float]]:
    """N rank bundles; the first also fits the replica actor."""
    rank, actor = rank_bundle(device, threads), actor_bundle(actor_options)
    if device == "cuda" and actor.get("GPU", 0) > 1:
        raise ConfigError(
            f"ray_actor_options.num_gpus={actor['GPU']:g} with tensor_parallel_size {tp}: each rank gets a bundle "
            "with one GPU and the replica runs in the first; allowed: num_gpus 0 or 1"
        )
    first = {res: max(rank.get(res, 0.0), actor.get(res, 0.0)) for res in [*rank, *(r for r in actor if r not in rank)]}
    return [first] + [dict(rank) for _ in range(tp - 1)]


def placement_options(tp: int, device: str, threads: int, actor_options: dict) -> dict:
    """The Serve deployment options that reserve a replica's ranks (none at TP 1)."""
    if tp == 1:
        return {}
    return {
        "placement_group_bundles": bundles(tp, device, threads, actor_options),
        "placement_group_strategy": STRATEGY,
    }


def claim_bundle_gpus(tp: int) -> str:
    """In a CUDA replica with TP > 1: make the GPUs of all N bundles visible to this process and the ranks it
    starts (CUDA_VISIBLE_DEVICES, bundle order); returns the value set. Must run before CUDA is initialised."""
    import ray
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = get_current_placement_group()
    if group is None:
        raise RuntimeError(f"tensor_parallel_size {tp} needs the replica's placement group (placement_group_bundles)")

    @ray.remote(num_cpus=0, num_gpus=1)
    def gpu_of_bundle() -> str:
        return str(ray.get_gpu_ids()[0])

    own = [str(i) for i in ray.get_gpu_ids()]
    probes = [
        gpu_of_bundle.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
        for i in range(1, tp)
    ]
    visible = ",".join(own[:1] + ray.get(probes))
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    return visible
