"""Capacity profiles shipped inside the package, so the planner has one for the default model
without a measurement (`splitserve up --planner` with no flags).

`planner/profiles/<model>.json` is a copy of the profile measured for that model in
bench/profiles/ (bench/ is not installed); a test checks the copy has not drifted. Each says
where and when it was measured (`meta`): on other hardware it is a starting point, and
`splitserve profile` measures the machine at hand.
"""

from __future__ import annotations

import importlib.resources
import pathlib

# model alias -> the bench/profiles/ file the shipped copy was taken from
SOURCES = {"smollm2-135m": "smollm2-135m-cpu2.json"}


def shipped_profile(model: str) -> pathlib.Path | None:
    """The shipped profile of `model` (an alias such as smollm2-135m), None when there is none."""
    if model not in SOURCES:
        return None
    path = importlib.resources.files("splitserve.planner") / "profiles" / f"{model}.json"
    return pathlib.Path(str(path)) if path.is_file() else None
