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

from splitserve.platform.errors import SplitserveError
from splitserve.platform.observability import logfmt
from splitserve.platform.settings import worker_args


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags (platform/settings/worker_args.py holds each one's name, type and default)."""
    worker_args.add_arguments(p, worker_args.engine_names())


def engine_config(args):
    """The EngineConfig of parsed engine flags."""
    return worker_args.WorkerArgs.from_namespace(args, worker_args.engine_names()).engine_config()


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
