"""`splitserve operator`: the subcommand's flags, --print-crd, --render, and how it starts kopf."""

from __future__ import annotations

import argparse
import pathlib

import kopf
import pytest
import yaml

from splitserve.operator import cli
from splitserve.operator.checks import InvalidSpecError
from splitserve.operator.crd import crd_yaml
from splitserve.platform.errors import SplitserveError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="splitserve")
    cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["operator", *argv])


def test_print_crd(capsys):
    assert cli.run(parse("--print-crd")) == 0
    assert capsys.readouterr().out == crd_yaml()


def test_render_prints_the_children_of_an_example(capsys):
    assert cli.run(parse("--render", str(ROOT / "deploy" / "examples" / "llama-3-8b-gpu.yaml"))) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert len(docs) == 19  # the 16 children of every service, 2 ScaledObjects, 1 ServiceMonitor
    assert {d["metadata"]["namespace"] for d in docs} == {"llm"}
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ScaledObject"] == [
        "llama3-8b-prefill",
        "llama3-8b-decode",
    ]


def test_render_rejects_an_invalid_spec_with_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "serving.splitserve.io/v1alpha1",
                "kind": "InferenceService",
                "metadata": {"name": "bad"},
                "spec": {"model": {"uri": "m", "dtype": "int8"}},
            }
        )
    )
    with pytest.raises(InvalidSpecError) as err:
        cli.run(parse("--render", str(bad)))
    assert isinstance(err.value, SplitserveError)  # the splitserve command prints it and exits 2
    assert str(err.value).startswith("spec.model.dtype: Input should be 'float32', 'bfloat16' or 'float16'")


@pytest.mark.parametrize(
    "argv,clusterwide,namespaces",
    [
        ((), True, []),
        (("--all-namespaces",), True, []),
        (("-n", "llm", "--namespace", "staging"), False, ["llm", "staging"]),
    ],
)
def test_run_starts_kopf_standalone_with_the_chosen_scope(monkeypatch, tmp_path, argv, clusterwide, namespaces):
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text("reconcile: {resyncSeconds: 7}\n")
    calls = []
    monkeypatch.setattr(kopf, "run", lambda **kw: calls.append(kw))
    monkeypatch.setattr(kopf, "configure", lambda **kw: None)
    assert cli.run(parse(*argv, "--defaults", str(defaults), "--liveness", "http://0.0.0.0:8080/healthz")) == 0
    (kw,) = calls
    assert (kw["standalone"], kw["clusterwide"], kw["namespaces"]) == (True, clusterwide, namespaces)
    assert kw["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"
    (timer,) = [h for h in kw["registry"]._spawning.get_all_handlers() if h.id == "resync"]
    assert timer.interval == 7  # the chart's defaults file reached the registry


def test_all_namespaces_and_namespace_are_exclusive():
    with pytest.raises(SystemExit):
        parse("--all-namespaces", "-n", "llm")


def test_the_splitserve_command_has_the_operator_subcommand(capsys):
    """Needs the entry point `operator = "splitserve.operator.cli:register"` in pyproject.toml."""
    from splitserve.platform.cli import main

    assert main(["operator", "--print-crd"]) == 0
    assert capsys.readouterr().out == crd_yaml()
