"""`splitserve bench`: load-test any OpenAI-compatible /v1/completions endpoint (docs/bench.md).

    splitserve bench --url http://127.0.0.1:8000 --model smollm2-135m --workload w1 --rate 0.5 \\
        --num-requests 128 --warmup 2 --seed 0 --slo ttft=2,tpot=0.15 --output w1.json
    splitserve bench --url http://127.0.0.1:8000 --workload w4 --concurrency 4

Prints a short table on stdout, progress on stderr, and with --output the full JSON (every
request's timings included). Invalid arguments exit with status 2 and a message; a run where no
request succeeded exits with 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import pathlib
import sys

from splitserve.bench.loadgen import workloads
from splitserve.bench.loadgen.metrics import parse_slo
from splitserve.platform.errors import ConfigError, SplitserveError


def _positive(unit: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not value > 0:  # also rejects nan
            raise argparse.ArgumentTypeError(f"must be a positive number{unit}, got {text!r}")
        return value

    return parse


_rate = _positive(" (per second) or inf")


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def _slo(text: str):
    try:
        return parse_slo(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"must start with http:// or https://, got {text!r}")
    return text


def _param(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. zipf=1.1), got {text!r}")
    return key.strip(), value.strip()


def _extra_body(text: str) -> dict:
    from splitserve.bench.loadgen.client import RESERVED_FIELDS

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{\"top_k\": 1}}' ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    taken = sorted(set(value) & set(RESERVED_FIELDS))
    if taken:
        raise argparse.ArgumentTypeError(
            f"{taken} are set by the workload; allowed: any field but {', '.join(RESERVED_FIELDS)}"
        )
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, type=_url, help="base URL of the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m", help="the `model` field of every request")
    p.add_argument("--workload", required=True, choices=list(workloads.WORKLOADS), help="docs/bench.md")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument(
        "--rate", type=_rate, help="open loop: arrivals per second (requests; sessions for w2); inf: all at once"
    )
    load.add_argument("--concurrency", type=_int_at_least(1), help="closed loop: at most N requests in flight")
    p.add_argument(
        "--burstiness",
        type=_positive(" or inf"),
        default=None,
        help="gamma shape of the inter-arrival times with --rate (1: Poisson, default)",
    )
    p.add_argument(
        "--num-requests", type=_int_at_least(1), default=None, help="measured requests (default: the workload's)"
    )
    p.add_argument("--warmup", type=_int_at_least(0), default=0, help="warm-up requests, excluded from the metrics")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", type=_slo, default=None, metavar="ttft=S,tpot=S,e2e=S", help="goodput SLOs in seconds")
    p.add_argument(
        "--workload-param",
        type=_param,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a workload parameter (repeatable), e.g. zipf=1.1",
    )
    p.add_argument(
        "--extra-body",
        type=_extra_body,
        default={},
        metavar="JSON",
        help='fields merged into every request, e.g. \'{"logit_bias": {"2": -100}}\' for a server without ignore_eos',
    )
    p.add_argument(
        "--prompt-format",
        choices=["token-ids", "text"],
        default="token-ids",
        help="text: send each prompt as the text of its ids, for servers without token-id prompts",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="with --prompt-format text: the model whose tokenizer turns ids into text (default: --model)",
    )
    p.add_argument("--output", default=None, help="write the JSON results here")
    p.add_argument("--request-timeout", type=_positive(" of seconds"), default=600.0, metavar="SECONDS")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="load-test an OpenAI-compatible endpoint (vLLM bench serve metrics)",
        description=__doc__.split("\n\n")[0],
    )
    add_arguments(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from splitserve.bench.loadgen import report, runner  # httpx and numpy only when running

    if args.burstiness is not None and args.concurrency is not None:
        raise ConfigError("--burstiness shapes the arrivals of --rate; it has no meaning with --concurrency")
    if args.output and not pathlib.Path(args.output).resolve().parent.is_dir():
        raise ConfigError(
            f"--output {args.output}: the folder {pathlib.Path(args.output).resolve().parent} does not exist"
        )
    if args.tokenizer and args.prompt_format != "text":
        raise ConfigError("--tokenizer is used only with --prompt-format text")
    wl = workloads.build(args.workload, dict(args.workload_param), args.num_requests, args.warmup, args.seed)
    if args.prompt_format == "text":
        from splitserve.platform.tokenizer import load_tokenizer

        name = args.tokenizer or args.model
        try:
            tokenizer = load_tokenizer(name)
        except ConfigError as exc:
            raise ConfigError(f"--prompt-format text needs a tokenizer: {exc}; pass --tokenizer MODEL") from None
        if tokenizer is None:
            raise ConfigError(f"--prompt-format text: {name} has no tokenizer; pass --tokenizer MODEL")
        wl = workloads.as_text(wl, tokenizer)
    cfg = runner.RunConfig(
        url=args.url,
        model=args.model,
        rate=args.rate,
        concurrency=args.concurrency,
        burstiness=1.0 if args.burstiness is None else args.burstiness,
        seed=args.seed,
        request_timeout_s=args.request_timeout,
        api_key=args.api_key,
        progress=not args.no_progress,
        extra_body=args.extra_body,
        prompt_format=args.prompt_format,
    )
    result = asyncio.run(runner.run(cfg, wl))
    doc = report.build_report(cfg, wl, result, args.slo)
    if args.output:
        pathlib.Path(args.output).write_text(json.dumps(doc, indent=1) + "\n")
    print(report.text_table(doc))
    if doc["summary"]["completed"] == 0:
        print(f"splitserve bench: all {wl.num_requests} requests failed; first: {doc['errors'][0]}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m splitserve.bench.loadgen.cli …`: the same command without the other subcommands."""
    parser = argparse.ArgumentParser(prog="splitserve bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_bench(args)
    except SplitserveError as exc:
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
