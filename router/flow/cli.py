"""The flow-control flags of `splitserve router` and `splitserve up` (they override the config
file's `flow_control:` section; docs/router.md)."""

from __future__ import annotations

import argparse


def objective(text: str) -> tuple[str, int]:
    name, _, band = text.partition("=")
    if name and band.lstrip("-").isdigit():
        return name, int(band)
    raise argparse.ArgumentTypeError(f"{text!r}: need NAME=BAND, e.g. interactive=10 or batch=-1")


def add_args(p) -> None:
    g = p.add_argument_group("flow control at the gateway (router/flow/, off by default)")
    g.add_argument(
        "--flow-control",
        action="store_true",
        default=None,
        help="queue requests in the gateway by band and flow while the workers are saturated",
    )
    g.add_argument(
        "--flow-objective",
        type=objective,
        action="append",
        default=None,
        metavar="NAME=BAND",
        help="an objective clients name in x-gateway-inference-objective, with its band (higher is "
        "more important, negative is sheddable); repeatable",
    )
    g.add_argument("--flow-max-queued", type=int, default=None, metavar="N", help="queued requests per band (256)")
    g.add_argument("--flow-max-wait", type=float, default=None, metavar="S", help="seconds a request may queue (30)")
    g.add_argument(
        "--flow-max-running",
        type=int,
        default=None,
        metavar="N",
        help="running requests per decode worker before it counts as saturated (0: no cap)",
    )
    g.add_argument(
        "--flow-reserved-running",
        type=int,
        default=None,
        metavar="N",
        help="of --flow-max-running, slots only bands >= 1 may take",
    )


def overrides(args) -> dict:
    """Dotted config overrides from the flags given (None for the ones left out)."""
    objectives = getattr(args, "flow_objective", None)
    return {
        "flow_control.enabled": getattr(args, "flow_control", None),
        "flow_control.objectives": dict(objectives) if objectives else None,
        "flow_control.max_queued_per_band": getattr(args, "flow_max_queued", None),
        "flow_control.max_queue_wait_s": getattr(args, "flow_max_wait", None),
        "flow_control.max_running_per_worker": getattr(args, "flow_max_running", None),
        "flow_control.reserved_running": getattr(args, "flow_reserved_running", None),
    }
