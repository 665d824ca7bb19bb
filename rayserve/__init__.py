"""`splitserve serve --backend ray`: the router and the worker pools as Ray Serve applications.

Why this is a package of its own. Running on Ray Serve needs glue on both sides of the
router/workers line: the gateway as an ingress deployment with discovery through a registry
deployment (router side), a worker pool as a deployment that heartbeats into that registry and
reports its queue depth to the autoscaler (worker side), and the config, its rendering and the
driver that deploys all three applications. Split across router/ and workers/, one feature lived
in two layers that may not import each other, held together by import-path strings. Here it is
one composition layer above both, like an application's entry point:

- it may import `splitserve.router`, `splitserve.workers` and `splitserve.platform`;
- nothing of ours imports it (platform, workers, router, operator, planner, bench stay
  Ray-free); `splitserve serve` reaches it through its console entry point, and Ray reaches
  `ingress:build_gateway`, `replica:build_pool` and `autoscale:queue_depth_policy` through the
  import paths of the rendered Serve config;
- only `replica.py` loads the engine (torch), and only inside the replica's own process: the
  driver (`serve.py`, `config.py`), the ingress and the autoscaling policy (which the Serve
  controller imports) stay torch-free.

tests/layering.py checks all three. The folder is not named `ray`, which would read as the ray
package itself. docs/ray.md describes the deployment.
"""
