"""bench/revision_arms.py, which the before/after benchmarks (engine_ab, gateway_ab) stand on: a
process started in an arm imports that arm's code and finds that arm's CLI commands, not the
working tree's editable install."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from revision_arms import alternating, arm_env, package_dir  # noqa: E402

PROBE = r"""
import json
from importlib.metadata import entry_points
import splitserve.platform.cli as cli, splitserve.router.core.pipeline as pipeline
commands = {e.name: e.value for e in entry_points(group="splitserve.commands")}
print(json.dumps({"cli": cli.__file__, "pipeline": pipeline.__file__, "commands": commands}))
"""


def test_an_arm_imports_its_own_tree_and_commands(tmp_path):
    # A copy of the tree's code folders stands in for a revision's checkout; one command is
    # renamed in its pyproject, so the probe can tell whose entry points it found.
    tree = tmp_path / "tree"
    tree.mkdir()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'router = "splitserve.router.main:register"' in pyproject
    (tree / "pyproject.toml").write_text(pyproject.replace("\nrouter = ", "\nrouter-renamed = "))
    for folder in ("platform", "router", "workers", "launch", "operator", "planner", "rayserve", "bench"):
        (tree / folder).symlink_to(ROOT / folder)
    arm = package_dir(tree, tmp_path / "arm")

    # From a folder of its own: the repository root holds the editable install's egg-info, which
    # would come first on the path (the head arm of a benchmark runs there: same commands).
    out = subprocess.run(
        [sys.executable, "-S", "-c", PROBE], env=arm_env(arm), cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert found["cli"].startswith(str(arm)) and found["pipeline"].startswith(str(arm)), found
    assert "router-renamed" in found["commands"] and "router" not in found["commands"], found["commands"]
    assert found["commands"]["router-renamed"] == "splitserve.router.main:register"


def test_rounds_alternate_which_arm_runs_first():
    # Load that drifts over a run must not always favour the arm that runs first in each round.
    assert list(alternating(3)) == [(0, "base"), (0, "head"), (1, "head"), (1, "base"), (2, "base"), (2, "head")]
