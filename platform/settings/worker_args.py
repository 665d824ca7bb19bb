"""`WorkerArgs`: every `splitserve worker` setting, written once (vLLM's `EngineArgs`).

Each field of the dataclass below is one worker flag: its name on the command line, its type,
its default and its help sit in the field's declaration, and so does where its value lands (`to`:
a dotted path into the `EngineConfig` of platform/config.py, or into the worker's own config,
workers/config.py). Everything else is derived from that one table:

- `add_arguments(parser)` builds the argparse flags (`splitserve worker`, and the engine part
  for `generate` / `chat`; `splitserve up` takes the subset it passes on);
- `from_namespace(ns)` reads them back; `engine_config()` builds the EngineConfig and
  `worker_fields()` the worker config's fields;
- `to_argv()` renders the settings as `splitserve worker` flags (the non-default ones, plus
  any a caller wants spelled out), which is what `up` and the operator's pod renderer run.

So adding a worker setting is one field here (plus its home in EngineConfig or WorkerConfig).
The rules that tie two settings together are functions in this module too (`for_role`,
`with_flow_control`, `check_kv_reuse`), so a launcher and a pod renderer apply them alike.
Torch-free: the operator, the router's `up` and the Ray driver import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from splitserve.platform.config import (
    KV_CACHE_DTYPES,
    SCHEDULING_POLICIES,
    SUPPORTED_DTYPES,
    EngineConfig,
    KVTierConfig,
    SpeculativeConfig,
    parse_byte_size,
)
from splitserve.platform.errors import ConfigError
from splitserve.platform.quant import QUANTIZATION_MODES
from splitserve.platform.wire.disaggregation import DISAGGREGATION_MODES

GiB = 1024**3
ROLES = ("prefill", "decode", "both")
CLI_TRANSPORTS = ("ucx", "tcp", "auto")  # auto: tcp, plus CUDA IPC on a GPU (workers/transfer/cuda_ipc.py)


@dataclass(frozen=True)
class Flag:
    """How one WorkerArgs field appears on the command line and where its value goes.

    `name`: the flag; a bool field defaulting to True is spelled `--no-...` and clears it.
    `to`: "engine.<section>.<field>" / "engine.<field>" / "worker.<field>"; "" for a value
    that `engine_config` composes itself (the KV tier). `parse`: the argparse type (None: the
    field's type). `convert`: the flag's value -> the config's (e.g. GiB -> bytes). `env`: an
    environment variable that supplies the default when the parser is built. `aliases`: other
    spellings of the flag (vLLM's `-tp`)."""

    name: str
    help: str = ""
    to: str = ""
    choices: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None
    convert: Callable[[Any], Any] | None = None
    env: str = ""
    metavar: str | None = None
    aliases: tuple[str, ...] = ()


def setting(default, name: str, help: str = "", **flag) -> Any:
    return field(default=default, metadata={"flag": Flag(name, help, **flag)})


def _argparse_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a function that raises ConfigError: a bad value exits 2 with its message."""

    def parse(text: str):
        try:
            convert(text)
        except (ConfigError, TypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return convert(text)

    parse.__name__ = convert.__name__
    return parse


def speculative_json(text: str) -> str:
    """--speculative-config: checked here, kept as the JSON text (what to_argv passes on)."""
    SpeculativeConfig.from_json(text)
    return text


def parse_lora_modules(specs) -> tuple[tuple[str, str], ...]:
    """`--lora-modules name=path ...` as (name, path) pairs; ConfigError naming a bad entry."""
    pairs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules {spec!r} is invalid; allowed: NAME=PATH (a PEFT adapter folder)")
        pairs.append((name, path))
    return tuple(pairs)


@dataclass(frozen=True)
class WorkerArgs:
    """One worker's settings. The field order is the order `to_argv` renders them in."""

    role: str = setting("both", "--role", to="worker.role", choices=ROLES)
    model: str = setting(
        "smollm2-135m", "--model", "alias, .gguf path, HF folder or random:<preset>", to="engine.model"
    )
    dtype: str = setting("float32", "--dtype", to="engine.device.dtype", choices=SUPPORTED_DTYPES)
    max_model_len: int | None = setting(None, "--max-model-len", to="engine.scheduler.max_model_len")
    block_size: int = setting(16, "--block-size", to="engine.cache.block_size")
    max_num_seqs: int = setting(64, "--max-num-seqs", to="engine.scheduler.max_num_seqs")
    kv_cache_memory_gib: float = setting(
        0.5,
        "--kv-cache-memory",
        "memory for the KV cache in GiB (default 0.5)",
        to="engine.cache.kv_cache_memory_bytes",
        convert=lambda gib: int(gib * GiB),
        metavar="GIB",
    )
    host: str = setting("127.0.0.1", "--host", "address to bind (0.0.0.0 in a pod)", to="worker.host")
    advertise_host: str = setting(
        "",
        "--advertise-host",
        "address other workers reach this one at (default: --host; in a pod, the pod IP)",
        to="worker.advertise_host",
    )
    grpc_port: int = setting(50051, "--grpc-port", to="worker.grpc_port")
    metrics_port: int = setting(9090, "--metrics-port", to="worker.metrics_port")
    kv_transport: str = setting(
        "ucx",
        "--kv-transport",
        "how KV blocks travel: ucx, tcp, or auto (tcp, plus CUDA IPC between workers on one node "
        "that can reach each other's GPU memory; needs --kv-secret-file)",
        to="worker.kv_transport",
        choices=CLI_TRANSPORTS,
    )
    kv_port: int = setting(13337, "--kv-port", to="worker.kv_port")
    kv_secret_file: str = setting(
        "",
        "--kv-secret-file",
        "file holding the service's KV-transfer secret: peers must prove they hold it "
        "(default: $SPLITSERVE_KV_SECRET_FILE; empty: no KV authentication)",
        to="worker.kv_secret_file",
        env="SPLITSERVE_KV_SECRET_FILE",
    )
    tls_cert: str = setting(
        "",
        "--tls-cert",
        "serve gRPC over mutual TLS: this worker's certificate (PEM; also used to call prefill workers)",
        to="worker.tls_cert",
        env="SPLITSERVE_TLS_CERT",
    )
    tls_key: str = setting("", "--tls-key", "its private key (PEM)", to="worker.tls_key", env="SPLITSERVE_TLS_KEY")
    tls_ca: str = setting(
        "", "--tls-ca", "the CA every client certificate must be signed by", to="worker.tls_ca", env="SPLITSERVE_TLS_CA"
    )
    tls_check_peer_roles: bool = setting(
        False,
        "--tls-check-peer-roles",
        "with mTLS: serve each RPC only to callers whose certificate names the right role "
        "(SAN splitserve-router: Generate, WatchEvents, LoRA; splitserve-worker: Prefill)",
        to="worker.tls_check_peer_roles",
    )
    speculative_config: str | None = setting(
        None,
        "--speculative-config",
        'speculative decoding, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (default: off; docs/engine.md)',
        to="engine.speculative",
        parse=_argparse_type(speculative_json),
        convert=lambda text: SpeculativeConfig.from_json(text) if text else None,
        metavar="JSON",
    )
    kv_tier_bytes: int | None = setting(
        None,
        "--kv-tier-bytes",
        "a second KV tier of this size (e.g. 4GiB, 512MiB, or bytes) that keeps the blocks the "
        "cache evicts and copies them back on a prefix hit (default: off; docs/kv-tiers.md)",
        parse=_argparse_type(parse_byte_size),
        metavar="SIZE",
    )
    kv_tier_dir: str | None = setting(
        None,
        "--kv-tier-dir",
        "keep the second tier in files under this folder (CPU workers); without it the tier is "
        "host memory. Needs --kv-tier-bytes",
        metavar="DIR",
    )
    kv_pull: bool = setting(
        True,
        "--no-kv-pull",
        "recompute a prefix another worker holds instead of pulling its KV (docs/kv-tiers.md)",
        to="worker.kv_pull",
    )
    max_pull_blocks: int = setting(
        1024,
        "--max-pull-blocks",
        "the most KV blocks one pull fetches (default 1024); the rest of the prompt is computed",
        to="worker.max_pull_blocks",
    )
    scheduling_policy: str = setting(
        "fcfs",
        "--scheduling-policy",
        "vLLM's: fcfs (arrival order) or priority (waiting requests by the gateway's band, then "
        "the request's priority, lower first; docs/router.md)",
        to="engine.scheduler.policy",
        choices=SCHEDULING_POLICIES,
    )
    device: str = setting("cpu", "--device", "cpu, cuda or cuda:N", to="engine.device.device")
    quantization: str = setting(
        "auto",
        "--quantization",
        "how weights are served: auto (default: each weight in the fast packed format nearest "
        "its stored type on an AVX2 CPU), none (dequantize to --dtype: the reference), or one "
        "format for all: int4, w4a16, w4a8, int8, fp16 (docs/engine.md)",
        to="engine.device.quantization",
        choices=QUANTIZATION_MODES,
    )
    kv_cache_dtype: str = setting(
        "auto",
        "--kv-cache-dtype",
        "the KV cache's precision: auto (default: float16 where a fast --quantization mode serves "
        "the weights on a CPU, else --dtype), or float32, float16, bfloat16",
        to="engine.device.kv_cache_dtype",
        choices=KV_CACHE_DTYPES,
    )
    threads: int = setting(0, "--threads", "torch CPU threads (0: torch's default)", to="engine.device.num_threads")
    # Tensor parallelism (vLLM's and torchrun's names). In a LeaderWorkerSet pod the group's size,
    # this pod's index and the leader's address come from the controller's environment.
    tensor_parallel_size: int = setting(
        1,
        "--tensor-parallel-size",
        "ranks the model is split over, one process each (docs/engine.md)",
        to="engine.parallel.tensor_parallel_size",
        aliases=("-tp",),
    )
    nnodes: int = setting(
        1,
        "--nnodes",
        "nodes the ranks span (default 1, or LWS_GROUP_SIZE)",
        to="engine.parallel.nnodes",
        env="LWS_GROUP_SIZE",
    )
    node_rank: int = setting(
        0,
        "--node-rank",
        "this node's index (default 0, or LWS_WORKER_INDEX)",
        to="engine.parallel.node_rank",
        env="LWS_WORKER_INDEX",
    )
    master_addr: str = setting(
        "127.0.0.1",
        "--master-addr",
        "rank 0's host (default 127.0.0.1, or LWS_LEADER_ADDRESS)",
        to="engine.parallel.master_addr",
        env="LWS_LEADER_ADDRESS",
    )
    master_port: int = setting(0, "--master-port", "rank 0's port (0: a free one)", to="engine.parallel.master_port")
    enforce_eager: bool = setting(
        False,
        "--enforce-eager",
        "CUDA: no CUDA graphs, every step eager (default: decode steps replay graphs captured at start)",
        to="engine.device.enforce_eager",
    )
    max_num_batched_tokens: int | None = setting(
        None,
        "--max-num-batched-tokens",
        "tokens per engine step (default 512; with --no-chunked-prefill, max_model_len)",
        to="engine.scheduler.max_num_batched_tokens",
    )
    enable_prefix_caching: bool = setting(True, "--no-prefix-caching", to="engine.cache.enable_prefix_caching")
    enable_chunked_prefill: bool = setting(True, "--no-chunked-prefill", to="engine.scheduler.enable_chunked_prefill")
    share_prefix_in_flight: bool = setting(
        True,
        "--no-share-prefix-in-flight",
        "compute a prefix again when another request is computing it in the same batch",
        to="engine.scheduler.share_prefix_in_flight",
    )
    lora_modules: tuple[str, ...] = setting(
        (),
        "--lora-modules",
        "PEFT LoRA adapters to load at start; a request selects one with model=NAME",
        to="engine.lora.modules",
        convert=parse_lora_modules,
        metavar="NAME=PATH",
    )
    max_loras: int = setting(
        4, "--max-loras", "distinct LoRA adapters one engine step may mix", to="engine.lora.max_loras"
    )
    max_lora_rank: int = setting(
        64, "--max-lora-rank", "the largest LoRA rank accepted", to="engine.lora.max_lora_rank"
    )
    max_cpu_loras: int | None = setting(
        None,
        "--max-cpu-loras",
        "LoRA adapters kept in memory, least recently used evicted (default: --max-loras)",
        to="engine.lora.max_cpu_loras",
    )
    disaggregation: str = setting(
        "conditional", "--disaggregation", to="worker.disaggregation", choices=tuple(DISAGGREGATION_MODES)
    )
    min_prefill_tokens: int = setting(
        256,
        "--min-prefill-tokens",
        "conditional mode: remote prefill only when at least this many prompt tokens are uncached",
        to="worker.min_prefill_tokens",
    )
    transfer_deadline_s: float = setting(
        30.0, "--transfer-deadline", "seconds for a remote prefill", to="worker.transfer_deadline_s"
    )
    drain_grace_s: float = setting(
        120.0, "--drain-grace", "seconds to finish in-flight work on SIGTERM", to="worker.drain_grace_s"
    )
    kv_layer_streaming: bool = setting(
        True,
        "--no-kv-layer-streaming",
        "prefill role: send the KV after the whole prompt is computed instead of per layer",
        to="worker.kv_layer_streaming",
    )

    def __post_init__(self) -> None:
        for f in flags():
            allowed = f.metadata["flag"].choices
            if allowed and getattr(self, f.name) not in allowed:
                raise ConfigError(f"{f.name}={getattr(self, f.name)!r} is not supported; allowed: {', '.join(allowed)}")
        if isinstance(self.lora_modules, list):  # from a YAML list or argparse's nargs
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        check_kv_reuse(self)
        self.engine_config(read_secret=False)  # every engine setting checked where it is declared

    # -- reading ----------------------------------------------------------------------------

    @classmethod
    def from_namespace(
        cls, ns: argparse.Namespace, names: typing.Iterable[str] | None = None, **overrides
    ) -> WorkerArgs:
        """The settings an argparse namespace holds: the fields in `names` (None: every field it
        has; the rest keep their defaults), then `overrides`."""
        wanted = {f.name for f in flags()} if names is None else set(names)
        values = {name: getattr(ns, name) for name in wanted if hasattr(ns, name)}
        values["advertise_host"] = values.get("advertise_host") or ""
        return cls(**{**values, **overrides})

    @classmethod
    def from_dict(cls, data: dict, where: str = "settings") -> WorkerArgs:
        """From a config file's mapping (the Ray config's `engine:`); unknown keys are a ConfigError."""
        names = [f.name for f in flags()]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} in {where}; allowed: {', '.join(names)}")
        try:
            return cls(**data)
        except TypeError as exc:  # a value of the wrong type that a comparison tripped over
            raise ConfigError(f"bad value in {where}: {exc}") from None

    def replace(self, **changes) -> WorkerArgs:
        return dataclasses.replace(self, **changes)

    def non_defaults(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in flags() if getattr(self, f.name) != f.default}

    # -- the configs ------------------------------------------------------------------------

    def engine_config(self, read_secret: bool = True) -> EngineConfig:
        """The engine's config. `read_secret`: key a file KV tier with the --kv-secret-file's
        contents (False only to validate, without touching the file)."""
        sections: dict[str, dict[str, Any]] = {}
        for path, value in self._targets("engine").items():
            section, _, name = path.rpartition(".")
            sections.setdefault(section, {})[name] = value
        hints = typing.get_type_hints(EngineConfig)
        kwargs = sections.pop("", {})
        kwargs.update({name: hints[name](**values) for name, values in sections.items()})
        return EngineConfig(**kwargs, kv_tier=self.kv_tier_config(read_secret))

    def worker_fields(self) -> dict[str, Any]:
        """The fields of the worker's own config (workers/config.py WorkerConfig.from_args)."""
        return self._targets("worker")

    def kv_tier_config(self, read_secret: bool = True) -> KVTierConfig | None:
        if self.kv_tier_bytes is None:
            return None
        secret = None
        if read_secret and self.kv_secret_file:  # the service's secret keys the file tier's MACs
            try:
                with open(self.kv_secret_file, "rb") as f:
                    secret = f.read().strip()
            except OSError as exc:
                raise ConfigError(f"cannot read the KV secret file {self.kv_secret_file!r}: {exc.strerror}") from None
        return KVTierConfig(max_bytes=self.kv_tier_bytes, directory=self.kv_tier_dir, secret=secret)

    def _targets(self, kind: str) -> dict[str, Any]:
        out = {}
        for f in flags():
            flag: Flag = f.metadata["flag"]
            head, _, path = flag.to.partition(".")
            if head == kind:
                value = getattr(self, f.name)
                out[path] = flag.convert(value) if flag.convert and value is not None else value
        return out

    # -- writing ----------------------------------------------------------------------------

    def to_argv(self, explicit: tuple[str, ...] = ()) -> list[str]:
        """`splitserve worker` flags for these settings: every non-default field, and the fields
        named in `explicit` even at their default (a pod spec that spells its settings out)."""
        argv: list[str] = []
        for f in flags():
            value, flag = getattr(self, f.name), f.metadata["flag"]
            if value == f.default and f.name not in explicit:
                continue
            if isinstance(value, bool):
                argv += [flag.name] if value != f.default else []
            elif isinstance(value, tuple):
                argv += [flag.name, *value] if value else []
            elif value is not None:
                argv += [flag.name, _text(value)]
        return argv


def _text(value) -> str:
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    return str(value)


def flags() -> tuple[dataclasses.Field, ...]:
    """The fields of WorkerArgs: one per worker flag."""
    return dataclasses.fields(WorkerArgs)


def engine_names() -> tuple[str, ...]:
    """The fields that set the engine (what `generate` and `chat` take)."""
    return tuple(f.name for f in flags() if f.metadata["flag"].to.partition(".")[0] in ("engine", ""))


def add_arguments(parser, names: typing.Iterable[str] | None = None, defaults: dict[str, Any] | None = None) -> None:
    """Add the worker's flags to `parser` (argparse): all of them, or the fields in `names`;
    `defaults` overrides a field's default (a launcher's own, e.g. `up`'s smaller KV cache)."""
    wanted = None if names is None else set(names)
    defaults = defaults or {}
    hints = typing.get_type_hints(WorkerArgs)
    for f in flags():
        if wanted is not None and f.name not in wanted:
            continue
        flag: Flag = f.metadata["flag"]
        default = defaults.get(f.name, f.default)
        if flag.env:
            default = os.environ.get(flag.env, default)
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": flag.help or None}
        if isinstance(f.default, bool):
            kwargs["action"] = "store_false" if f.default else "store_true"
        else:
            kwargs["type"] = flag.parse or _scalar(hints[f.name])
            kwargs.update(metavar=flag.metavar, choices=list(flag.choices) or None)
            if isinstance(f.default, tuple):
                kwargs.update(nargs="+", type=str)
        parser.add_argument(flag.name, *flag.aliases, **kwargs)


def _scalar(hint) -> type:
    """int for `int` and `int | None`, and so on."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


# The settings a launcher (`up`, the Ray replica) decides for each worker it starts: its role and
# model, where it listens, its credentials and its drain; it passes every other field on as given.
LAUNCHER_DECIDES = (
    "role",
    "model",
    "host",
    "advertise_host",
    "grpc_port",
    "metrics_port",
    "kv_port",
    "kv_transport",
    "kv_secret_file",
    "tls_cert",
    "tls_key",
    "tls_ca",
    "tls_check_peer_roles",
    "drain_grace_s",
)


# -- the rules that tie settings together (each written once) ---------------------------------


def check_kv_reuse(args: WorkerArgs) -> None:
    """The second tier's folder needs its size; pulls are either off or limited, not both."""
    if args.kv_tier_dir is not None and args.kv_tier_bytes is None:
        raise ConfigError("--kv-tier-dir needs --kv-tier-bytes (the tier's size limit, e.g. 4GiB)")
    if not args.kv_pull and args.max_pull_blocks != WorkerArgs.max_pull_blocks:
        raise ConfigError("--max-pull-blocks limits pulls and --no-kv-pull turns them off; allowed: one of the two")


def for_role(args: WorkerArgs, role: str) -> WorkerArgs:
    """The settings of a worker of `role`: a prefill worker samples one token per request, so it
    gets no speculative decoding (nothing to speculate)."""
    return args.replace(role=role, speculative_config=None if role == "prefill" else args.speculative_config)


def with_flow_control(args: WorkerArgs, enabled: bool) -> WorkerArgs:
    """With the gateway's flow control on, the workers order waiting requests by the band the
    gateway sends (`--scheduling-policy priority`)."""
    return args.replace(scheduling_policy="priority") if enabled else args
