"""The `splitserve` command line.

    splitserve generate --model smollm2-135m [--chat] [--max-tokens N] [--temperature T] [--seed S] [-tp N] "prompt"
    splitserve chat --model smollm2-135m

`generate` prints only the generated text on stdout (logs go to stderr); errors print one
line saying what was wrong and exit with status 2.

Other parts of splitserve add their subcommands (`worker`, `router`, `operator`, ...) through
the entry-point group `splitserve.commands` in pyproject.toml: each entry is a function
`register(subparsers)`. The platform layer stays free of imports from the layers above it.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from splitserve.platform import logfmt
from splitserve.platform.config import KV_CACHE_DTYPES
from splitserve.platform.errors import SplitserveError
from splitserve.platform.quant import QUANTIZATION_MODES

GiB = 1024**3


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf path, HF folder or random:<preset>")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--quantization",
        default="auto",
        choices=list(QUANTIZATION_MODES),
        help="how weights are served: auto (default: each weight in the fast packed format nearest "
        "its stored type on an AVX2 CPU), none (dequantize to --dtype: the reference), or one "
        "format for all: int4, w4a16, w4a8, int8, fp16 (docs/engine.md)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="the KV cache's precision: auto (default: float16 where a fast --quantization mode serves "
        "the weights on a CPU, else --dtype), or float32, float16, bfloat16",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: no CUDA graphs, every step eager (default: decode steps replay graphs captured at start)",
    )
    p.add_argument(
        "--kv-cache-memory", type=float, default=0.5, metavar="GIB", help="memory for the KV cache in GiB (default 0.5)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step (default 512; with --no-chunked-prefill, max_model_len)",
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=("fcfs", "priority"),
        help="vLLM's: fcfs (arrival order) or priority (waiting requests by the gateway's band, then "
        "the request's priority, lower first; docs/router.md)",
    )
    p.add_argument(
        "--no-share-prefix-in-flight",
        action="store_true",
        help="compute a prefix again when another request is computing it in the same batch",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="PEFT LoRA adapters to load at start; a request selects one with model=NAME",
    )
    p.add_argument("--max-loras", type=int, default=4, help="distinct LoRA adapters one engine step may mix")
    p.add_argument("--max-lora-rank", type=int, default=64, help="the largest LoRA rank accepted")
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="LoRA adapters kept in memory, least recently used evicted (default: --max-loras)",
    )
    p.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (default: off; docs/engine.md)',
    )
    p.add_argument(
        "--kv-tier-bytes",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="a second KV tier of this size (e.g. 4GiB, 512MiB, or bytes) that keeps the blocks the "
        "cache evicts and copies them back on a prefix hit (default: off; docs/kv-tiers.md)",
    )
    p.add_argument(
        "--kv-tier-dir",
        default=None,
        metavar="DIR",
        help="keep the second tier in files under this folder (CPU workers); without it the tier is "
        "host memory. Needs --kv-tier-bytes",
    )


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism (vLLM's and torchrun's names); unset ones come from a LeaderWorkerSet's
    environment, else the defaults (config.resolve_parallel)."""
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="ranks the model is split over, one process each (default 1; docs/engine.md)",
    )
    p.add_argument("--nnodes", type=int, default=None, help="nodes the ranks span (default 1, or LWS_GROUP_SIZE)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's index (default 0, or LWS_WORKER_INDEX)")
    p.add_argument("--master-addr", default=None, help="rank 0's host (default 127.0.0.1, or LWS_LEADER_ADDRESS)")
    p.add_argument("--master-port", type=int, default=None, help="rank 0's port (default: a free one)")


def parallel_config(args):
    """The ParallelConfig of the flags of add_parallel_args (absent ones: unset), the
    LeaderWorkerSet environment filling the rest."""
    import os

    from splitserve.platform.config import resolve_parallel

    return resolve_parallel(
        os.environ,
        getattr(args, "tensor_parallel_size", None),
        getattr(args, "nnodes", None),
        getattr(args, "node_rank", None),
        getattr(args, "master_addr", None),
        getattr(args, "master_port", None),
    )


def speculative_config(text: str):
    """argparse type of --speculative-config: a bad value exits with status 2 and says what is allowed."""
    from splitserve.platform.config import SpeculativeConfig
    from splitserve.platform.errors import ConfigError

    try:
        return SpeculativeConfig.from_json(text)
    except (ConfigError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def byte_size(text: str) -> int:
    """argparse type of a size: bytes, or a number with a unit (KiB, MiB, GiB, TiB, KB, MB, GB, TB)."""
    from splitserve.platform.config import parse_byte_size
    from splitserve.platform.errors import ConfigError

    try:
        return parse_byte_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kv_tier_config(args):
    """The second KV tier from --kv-tier-bytes / --kv-tier-dir (None: off); ConfigError if inconsistent."""
    from splitserve.platform.config import KVTierConfig
    from splitserve.platform.errors import ConfigError

    size, directory = getattr(args, "kv_tier_bytes", None), getattr(args, "kv_tier_dir", None)
    if size is None:
        if directory is not None:
            raise ConfigError("--kv-tier-dir needs --kv-tier-bytes (the tier's size limit, e.g. 4GiB)")
        return None
    secret_file = getattr(args, "kv_secret_file", "") or ""  # a worker's service secret keys the file tier
    secret = None
    if secret_file:
        import pathlib

        try:
            secret = pathlib.Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the KV secret file {secret_file!r}: {exc.strerror}") from None
    return KVTierConfig(max_bytes=size, directory=directory, secret=secret)


def engine_config(args):
    from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, LoraConfig, SchedulerConfig

    return EngineConfig(
        model=args.model,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=int(args.kv_cache_memory * GiB),
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_chunked_prefill=not args.no_chunked_prefill,
            share_prefix_in_flight=not args.no_share_prefix_in_flight,
            policy=getattr(args, "scheduling_policy", "fcfs"),
        ),
        device=DeviceConfig(
            device=args.device,
            dtype=args.dtype,
            num_threads=args.threads,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            enforce_eager=getattr(args, "enforce_eager", False),
        ),
        lora=LoraConfig(
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras,
            modules=tuple(parse_lora_modules(args.lora_modules)),
        ),
        speculative=getattr(args, "speculative_config", None),
        kv_tier=kv_tier_config(args),
        parallel=parallel_config(args),
    )


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """`--lora-modules name=path ...` as (name, path) pairs; ConfigError naming a bad entry."""
    from splitserve.platform.errors import ConfigError

    pairs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules {spec!r} is invalid; allowed: NAME=PATH (a PEFT adapter folder)")
        pairs.append((name, path))
    return pairs


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def sampling_params(args):
    from splitserve.platform.sampling.params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )


def cmd_generate(args) -> int:
    from splitserve.platform.engine.llm_engine import LLMEngine

    params = sampling_params(args)  # validate before loading the model
    engine = LLMEngine(engine_config(args))
    try:
        _generate(engine, args, params)
    finally:
        engine.close()  # the other ranks of a tensor-parallel group
    return 0


def _generate(engine, args, params) -> None:
    if args.chat:
        token_ids = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        engine.add_request(params=params, prompt_token_ids=token_ids)
    else:
        engine.add_request(args.prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")


def cmd_chat(args) -> int:
    from splitserve.platform.engine.llm_engine import LLMEngine

    params = sampling_params(args)
    engine = LLMEngine(engine_config(args))
    messages: list[dict] = []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"splitserve chat with {args.model} — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip():
            return 0
        messages.append({"role": "user", "content": line.strip()})
        engine.add_request(params=params, prompt_token_ids=engine.tokenizer.encode_chat(messages))
        reply = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                reply += out.new_text
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})


GLOBAL_OPTIONS_WITH_VALUES = ("--log-level", "--log-format")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line. Given `argv`, only the command it names is loaded: each command
    module imports what its process runs, so `splitserve router`, `up` or `usage` never import
    torch (the worker's engine) and start in a fraction of the time. `splitserve --help`, no
    command or an unknown one load them all, so the help and the error list every command."""
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument(
        "--log-format",
        default=None,
        choices=list(logfmt.FORMATS),
        help="text (default) or json, one object per line with trace_id and span_id "
        "(default: $SPLITSERVE_LOG_FORMAT or text)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    add_engine_args(gen)
    add_parallel_args(gen)
    add_sampling_args(gen, max_tokens=128)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("prompt")
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(chat)
    add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)
    commands = sorted(entry_points(group="splitserve.commands"), key=lambda e: e.name)
    named = _command_named(argv, {"generate", "chat", *(entry.name for entry in commands)})
    for entry in commands:
        if named is None or entry.name == named:
            entry.load()(sub)
    return parser


def _command_named(argv: list[str] | None, known: set[str]) -> str | None:
    """The command `argv` runs (its first positional word), or None when it names none we know."""
    args = iter(argv or ())
    for arg in args:
        if arg in GLOBAL_OPTIONS_WITH_VALUES:
            next(args, None)
        elif not arg.startswith("-"):
            return arg if arg in known else None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        logfmt.setup(args.log_level, logfmt.log_format(args.log_format))
    except ValueError as exc:  # a bad $SPLITSERVE_LOG_FORMAT
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except SplitserveError as exc:
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
