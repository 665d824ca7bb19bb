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

Signals: `splitserve serve` takes SIGTERM and SIGINT back from Ray after ray.init (Ray's core
worker would dump a stack and abort); either one, during start-up or while serving, stops Serve
and Ray and exits 0.
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
    p.add_argument(
        "--backend", default=None, help=f"overrides the config's backend; allowed: {', '.join(ray_config.BACKENDS)}"
    )
    p.add_argument("--config", required=True, help="the backend's config file (deploy/ray/serve.yaml, docs/ray.md)")
    p.add_argument("--model", default=None, help="overrides the config's model")
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="overrides the config's otlp_traces_endpoint: export request traces of the replicas "
        "to this OTLP gRPC collector",
    )
    p.add_argument(
        "--print-serve-config",
        action="store_true",
        help="print the Ray Serve config (serveConfigV2 of a KubeRay RayService) and exit",
    )
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    config = ray_config.load(
        args.config, backend=args.backend, model=args.model, otlp_traces_endpoint=args.otlp_traces_endpoint
    )
    if args.print_serve_config:
        print(yaml.safe_dump(ray_config.render(config), sort_keys=False), end="")
        return 0
    stop = threading.Event()
    take_signals(stop)
    print(
        f"splitserve serve: starting Ray Serve ({config.prefill.min_replicas} prefill, "
        f"{config.decode.min_replicas} decode replicas of {config.model})",
        file=sys.stderr,
        flush=True,
    )
    app = RayServe(config, stop_event=stop)
    try:
        app.start()
    except StartInterrupted:
        print("splitserve serve: stopped during start-up", file=sys.stderr, flush=True)
        return 0
    try:
        print(f"splitserve serve: serving {app.url} (model {config.model}); Ctrl-C stops it", flush=True)
        while not stop.wait(1.0):
            pass
        print("splitserve serve: stopping", file=sys.stderr, flush=True)
    finally:
        app.stop()
    print("splitserve serve: stopped", file=sys.stderr, flush=True)
    return 0


def take_signals(stop: threading.Event) -> None:
    """SIGTERM (how Kubernetes stops a pod) and SIGINT set `stop`. Called again after ray.init,
    which installs Ray's own SIGTERM handler in this process (a stack dump, then abort: exit 134)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


class StartInterrupted(Exception):
    """A signal arrived while the deployment was coming up; everything started was stopped again."""


class RayServe:
    """One deployment of `config` on Ray Serve (see the module docstring)."""

    def __init__(self, config: ray_config.RayServeConfig, stop_event: threading.Event | None = None):
        """`stop_event`: set by the owner's signal handlers (take_signals); start() then stops
        what it started and raises StartInterrupted."""
        self.config = config
        self.stop_event = stop_event
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

        try:
            self._init_ray(ray)
        except SystemExit as exc:
            # Ray's own SIGTERM handler, in place during ray.init, turns the signal into SystemExit(15).
            if self.stop_event is None or exc.code != signal.SIGTERM:
                raise
            self.stop_event.set()
            self.stop()
            raise StartInterrupted("stopped by SIGTERM while Ray was starting") from None
        try:
            self.config = self._with_security(self.config)
            rendered = ray_config.render(self.config)
            # serve_start/deploy_apps are what `serve run config.yaml` calls (Ray is pinned): the
            # applications are built from their import paths inside the cluster.
            client = serve_start(http_options=rendered["http_options"], proxy_location=rendered["proxy_location"])
            client.deploy_apps(ServeDeploySchema(**{"applications": rendered["applications"]}), _blocking=False)
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _with_security(self, config: ray_config.RayServeConfig) -> ray_config.RayServeConfig:
        """A local run without named files gets a throwaway CA, key pair and KV secret (mode 0600,
        removed by stop()), as `splitserve up`; named files or `insecure` are used as they are."""
        if config.security.insecure or config.security.is_complete:
            return config
        import dataclasses
        import secrets
        import tempfile

        from splitserve.platform.wire.grpc_tls import generate_dev_pki

        self._security_dir = tempfile.mkdtemp(prefix="splitserve-serve-", dir=config.ray.temp_dir or None)
        tls = generate_dev_pki(self._security_dir)
        secret = os.path.join(self._security_dir, "kv-secret")
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        return dataclasses.replace(
            config,
            security=ray_config.SecuritySettings(
                tls_cert=tls.cert, tls_key=tls.key, tls_ca=tls.ca, kv_secret_file=secret
            ),
        )

    def _init_ray(self, ray) -> None:
        cluster = self.config.ray
        if ray.is_initialized():
            return
        # Read by the Serve processes at import: replicas push their queue depth this often, and a
        # busy machine gets longer for the proxy's first health check (docs/design.md, environment notes).
        os.environ.setdefault(
            "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", str(self.config.autoscaling.metrics_interval_s)
        )
        os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
        if cluster.address == "local":
            kwargs = {
                "num_cpus": cluster.num_cpus,
                "include_dashboard": cluster.include_dashboard,
                "namespace": cluster.namespace,
                "log_to_driver": False,
            }
            if cluster.temp_dir:
                kwargs["_temp_dir"] = cluster.temp_dir
            ray.init(**kwargs)
            self.owns_ray = True
        else:
            ray.init(address=cluster.address, namespace=cluster.namespace)
        if self.stop_event is not None:
            take_signals(self.stop_event)

    def _wait_ready(self, timeout_s: float) -> None:
        from ray import serve

        deadline = time.monotonic() + timeout_s
        need = {"prefill": self.config.prefill.min_replicas, "decode": self.config.decode.min_replicas}
        last = "deploying"
        while time.monotonic() < deadline:
            if self.stop_event is not None and self.stop_event.is_set():
                raise StartInterrupted("stopped by a signal during start-up")
            failed = [
                f"{name}: {app.message}"
                for name, app in serve.status().applications.items()
                if app.status in ("DEPLOY_FAILED", "UNHEALTHY")
            ]
            if failed:
                raise RuntimeError("Ray Serve could not deploy splitserve:\n" + "\n".join(failed))
            try:
                counts = {role: sum(w["role"] == role for w in self.workers()) for role in need}
                last = f"registered replicas {counts}, need {need}"
                if all(counts[r] >= n for r, n in need.items()) and self.is_ready():
                    return
            except Exception as exc:  # noqa: BLE001 — the registry is not deployed yet
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

        try:
            if ray.is_initialized():
                try:
                    serve.shutdown()
                finally:
                    if self.owns_ray:
                        ray.shutdown()
                        self.owns_ray = False
        finally:
            if getattr(self, "_security_dir", None):
                import shutil

                shutil.rmtree(self._security_dir, ignore_errors=True)
                self._security_dir = None
