"""`splitserve operator`: run the kopf operator in this process, or print what it would create.

    splitserve operator [--all-namespaces | --namespace NS ...] [--defaults FILE] [--kubeconfig FILE]
                        [--liveness URL] [--verbose | --debug]
    splitserve operator --print-crd                  the CRD YAML (the chart's crds/ file)
    splitserve operator --render isvc.yaml           the children of an InferenceService, offline

The operator runs standalone (no kopf peering): deploy one replica (the chart does).
Registered into the `splitserve` command through the entry point `splitserve.commands`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import uuid


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "operator", help="run the InferenceService operator (kopf)", description=__doc__.split("\n\n")[0]
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)")
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    p.add_argument("--defaults", help="the chart's defaults file (autoscaling, image, resync)")
    p.add_argument("--kubeconfig", help="kubeconfig outside a cluster (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--liveness", help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--debug", action="store_true")
    p.add_argument("--print-crd", action="store_true", help="print the InferenceService CRD and exit")
    p.add_argument("--render", metavar="FILE", help="print the children of the InferenceService in FILE and exit")
    p.set_defaults(func=run)


def render_file(path: str, defaults: str | None) -> str:
    import yaml
    from pydantic import ValidationError

    from splitserve.operator.checks import InvalidSpecError, check_spec
    from splitserve.operator.reconcile import describe_validation_error
    from splitserve.operator.render import render
    from splitserve.operator.settings import load_settings
    from splitserve.operator.spec import parse_spec

    settings = load_settings(defaults)
    obj = yaml.safe_load(pathlib.Path(path).read_text())
    meta = obj["metadata"]
    try:
        spec = parse_spec(obj.get("spec") or {})
    except ValidationError as exc:
        raise InvalidSpecError(describe_validation_error(exc)) from None
    check_spec(spec, meta["name"], settings)
    uid = meta.get("uid") or str(uuid.uuid5(uuid.NAMESPACE_URL, meta["name"]))
    return yaml.safe_dump_all(
        render(spec, meta["name"], meta.get("namespace", "default"), uid, settings), sort_keys=False
    )


def run(args: argparse.Namespace) -> int:
    # Imports live here so that building the `splitserve` parser stays cheap for every command.
    from splitserve.operator.crd import crd_yaml
    from splitserve.operator.settings import load_settings

    if args.print_crd:
        sys.stdout.write(crd_yaml())
        return 0
    if args.render:
        sys.stdout.write(render_file(args.render, args.defaults))
        return 0
    import logging

    import kopf

    from splitserve.operator.handlers import build_registry

    logging.getLogger().handlers.clear()  # kopf installs its own handler; one line per record
    kopf.configure(verbose=args.verbose, debug=args.debug)
    registry = build_registry(load_settings(args.defaults), args.kubeconfig)
    kopf.run(
        registry=registry,
        standalone=True,
        clusterwide=args.all_namespaces or not args.namespace,  # -A, or no namespace named (the same scope)
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
    )
    return 0
