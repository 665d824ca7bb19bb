"""`splitserve serve --backend ray`: the router and both worker pools as Ray Serve applications.

    splitserve serve --backend ray --config deploy/ray/serve.yaml     # until Ctrl-C / SIGTERM
    splitserve serve --backend ray --config deploy/ray/serve.yaml --print-serve-config   # for KubeRay

The same as a Python API:

    with RayServe(ray_config.load("deploy/ray/serve.yaml")) as app:
        app.url              # http://127.0.0.1:8000/v1

`start()`: with `ray.address: local` a Ray instance owned by this process is started (dashboard
off by default, temp dir from the config); otherwise the running cluster is joined. Serve starts
with its HTTP proxy on the router config's gateway host:port, the three applications of
`ray_config.render()` are deployed by import path (the workers are built in Ray's processes,
never in this one), and `start()` returns once every pool has its minimum of replicas registered
and the gateway answers /ready. `stop()` shuts Serve down (replicas drain) and, for a local
instance, Ray itself: no Ray process is left behind.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import urllib.request

import yaml

from splitserve.platform.errors import ConfigError
from splitserve.rayserve import config as ray_config
from splitserve.router.main import url_host

log = logging.getLogger("splitserve.serve")

START_TIMEOUT_S = 600.0


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the router and worker pools on a cluster backend (Ray Serve)")
    p.add_argument("--backend", default=None, help=f"overrides the config's backend; allowed: {', '.join(ray_config.BACKENDS)}")
    p.add_argument("--config", required=True, help="the backend's config file (deploy/ray/serve.yaml, docs/ray.md)")
    p.add_argument("--model", default=None, help="overrides the config's model")
    p.add_argument("--print-serve-config", action="store_true",
                   help="print the Ray Serve config (serveConfigV2 of a KubeRay RayService) and exit")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    config = ray_config.load(args.config, backend=args.backend, model=args.model)
    if args.print_serve_config:
        print(yaml.safe_dump(ray_config.render(config), sort_keys=False), end="")
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"splitserve serve: starting Ray Serve ({config.prefill.min_replicas} prefill, "
          f"{config.decode.min_replicas} decode replicas of {config.model})", file=sys.stderr, flush=True)
    with RayServe(config) as app:
        print(f"splitserve serve: serving {app.url} (model {config.model}); Ctrl-C stops it", flush=True)
        stop.wait()
        print("splitserve serve: stopping", file=sys.stderr, flush=True)
    return 0


class RayServe:
    """One deployment of `config` on Ray Serve (see the module docstring)."""

    def __init__(self, config: ray_config.RayServeConfig):
        self.config = config
        host, port = config.gateway
        if port == 0:
            raise ConfigError("router.gateway.port=0: Ray Serve's proxy needs a fixed port; allowed: 1-65535")
        self.url = f"http://{url_host(host)}:{port}/v1"
        self.owns_ray = False

    def __enter__(self) -> RayServe:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        import ray
        from ray.serve._private.api import serve_start
        from ray.serve.schema import ServeDeploySchema

        self._init_ray(ray)
        try:
            rendered = ray_config.render(self.config)
            # serve_start/deploy_apps are what `serve run config.yaml` calls (Ray is pinned): the
            # applications are built from their import paths inside the cluster.
            client = serve_start(http_options=rendered["http_options"], proxy_location=rendered["proxy_location"])
            client.deploy_apps(ServeDeploySchema(**{"applications": rendered["applications"]}), _blocking=False)
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _init_ray(self, ray) -> None:
        cluster = self.config.ray
        if ray.is_initialized():
            return
        # Read by the Serve processes at import: replicas push their queue depth this often, and a
        # busy machine gets longer for the proxy's first health check (docs/design.md, environment notes).
        os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S",
                              str(self.config.autoscaling.metrics_interval_s))
        os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
        if cluster.address == "local":
            kwargs = {"num_cpus": cluster.num_cpus, "include_dashboard": cluster.include_dashboard,
                      "namespace": cluster.namespace, "log_to_driver": False}
            if cluster.temp_dir:
                kwargs["_temp_dir"] = cluster.temp_dir
            ray.init(**kwargs)
            self.owns_ray = True
        else:
            ray.init(address=cluster.address, namespace=cluster.namespace)

    def _wait_ready(self, timeout_s: float) -> None:
        from ray import serve

        deadline = time.monotonic() + timeout_s
        need = {"prefill": self.config.prefill.min_replicas, "decode": self.config.decode.min_replicas}
        last = "deploying"
        while time.monotonic() < deadline:
            failed = [f"{name}: {app.message}" for name, app in serve.status().applications.items()
                      if app.status in ("DEPLOY_FAILED", "UNHEALTHY")]
            if failed:
                raise RuntimeError("Ray Serve could not deploy splitserve:\n" + "\n".join(failed))
            try:
                counts = {role: sum(w["role"] == role for w in self.workers()) for role in need}
                last = f"registered replicas {counts}, need {need}"
                if all(counts[r] >= n for r, n in need.items()) and self.is_ready():
                    return
            except Exception as exc:   # noqa: BLE001 — the registry is not deployed yet
                last = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            time.sleep(0.5)
        raise TimeoutError(f"splitserve on Ray Serve was not ready after {timeout_s:.0f} s ({last})")

    def workers(self) -> list[dict]:
        """The worker replicas the registry knows: address, role, metrics, actor_name, replica_id."""
        from ray import serve

        ref = ray_config.registry_ref(self.config)
        return serve.get_deployment_handle(ref["deployment"], ref["app"]).workers.remote().result(timeout_s=10)

    def is_ready(self) -> bool:
        """The gateway answers /ready: the router watches a healthy decode replica."""
        try:
            with urllib.request.urlopen(self.url.removesuffix("/v1") + "/ready", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        import ray
        from ray import serve

        if ray.is_initialized():
            try:
                serve.shutdown()
            finally:
                if self.owns_ray:
                    ray.shutdown()
                    self.owns_ray = False
