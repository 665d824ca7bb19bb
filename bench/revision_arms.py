"""A git revision's code importable as `splitserve` beside the working tree's, for benchmarks that
compare a change against what came before it (bench/engine_ab.py, bench/gateway_ab.py).

An arm is a folder holding a `splitserve` package of links to one tree's code folders (read from
that tree's own pyproject.toml, so a revision from before a folder moved still imports) and a
dist-info with that tree's `splitserve.commands` entry points (the CLI finds its commands there).
A process started with `arm_env(arm)` imports that tree's code: its PYTHONPATH puts the arm ahead
of site-packages, so the working tree's editable install does not leak into a revision's arm.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import site
import subprocess
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Arm:
    tree: pathlib.Path  # its checkout: the revision's worktree, or the working tree for "head"
    path: pathlib.Path  # its package folder (the module docstring); a folder to run its processes in


@contextlib.contextmanager
def base_and_head(base: str) -> Iterator[dict[str, Arm]]:
    """{"base": revision `base`, "head": the working tree as it is}, each an Arm, for the duration."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        with revision_tree(base, tmp / "base-tree") as tree:
            yield {
                "base": Arm(tree, package_dir(tree, tmp / "base")),
                "head": Arm(ROOT, package_dir(ROOT, tmp / "head")),
            }


def alternating(rounds: int) -> Iterator[tuple[int, str]]:
    """(round, arm name) in the order the arms run: base first in even rounds, head first in odd,
    so load that drifts over the run hits both alike."""
    for r in range(rounds):
        for name in ("base", "head") if r % 2 == 0 else ("head", "base"):
            yield r, name


@contextlib.contextmanager
def revision_tree(revision: str, into: pathlib.Path) -> Iterator[pathlib.Path]:
    """`revision` checked out (git worktree, detached) at `into`, removed again afterwards."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(into), revision], check=True, capture_output=True
    )
    try:
        yield into
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(into)], capture_output=True)


def head_revision() -> str:
    """The working tree's commit, short (a report names both arms)."""
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


def package_dir(code_root: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """An arm (see the module docstring) for the tree at `code_root`, made at `into`."""
    project = tomllib.loads((code_root / "pyproject.toml").read_text())
    pkg = into / "splitserve"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").touch()
    for package, folder in project["tool"]["setuptools"]["package-dir"].items():
        (pkg / package.removeprefix("splitserve.")).symlink_to(code_root / folder)
    commands = project["project"].get("entry-points", {}).get("splitserve.commands", {})
    dist = into / "splitserve-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: splitserve\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(
        "[splitserve.commands]\n" + "".join(f"{name} = {target}\n" for name, target in commands.items())
    )
    return into


def arm_env(arm: pathlib.Path) -> dict[str, str]:
    """The environment of a process (and its children) that imports the arm's code."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(arm), *site.getsitepackages()])}
