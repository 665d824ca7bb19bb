"""Which capacity profile `splitserve up --planner` plans with, when `--profile` names none.

    1. the profile shipped for the model (planner/shipped.py): the default model has one;
    2. else a profile measured on this machine before, cached under
       $XDG_CACHE_HOME/splitserve/profiles/ (default ~/.cache), keyed by model and core count;
    3. else measure one now with a short `splitserve profile` sweep (a minute or two on a small
       model), with a progress line, and cache it for the next start.

Each choice is printed, with where the profile was measured, so a user knows what the planner
believes about the machine.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys

from splitserve.planner.profile import CapacityProfile
from splitserve.planner.shipped import shipped_profile

# A short sweep: enough points for the planner's interpolation, small enough for a first start.
QUICK_SWEEP = [
    "--prompt-lens",
    "128,512,1024",
    "--concurrency",
    "1,2,4,8",
    "--context",
    "256",
    "--decode-steps",
    "8",
    "--repeats",
    "1",
    "--notes",
    "measured by `splitserve up --planner` (quick sweep)",
]


def say(message: str) -> None:
    print(f"splitserve up: planner: {message}", file=sys.stderr, flush=True)


def cache_path(model: str, cores: int, cache_home: str | None = None) -> pathlib.Path:
    base = pathlib.Path(cache_home or os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    digest = hashlib.sha256(model.encode()).hexdigest()[:12]  # a path or URI as model: a safe file name
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in pathlib.Path(model).name)[:48]
    return base / "splitserve" / "profiles" / f"{stem}-{digest}-cpu{cores}.json"


def _describe(path: pathlib.Path) -> str:
    meta = CapacityProfile.load(str(path)).meta
    where = f"{meta.get('cpu_count', '?')} CPU cores, {meta.get('threads', '?')} thread(s)"
    return f"measured on {where} at {meta.get('measured', 'an unknown time')}"


def resolve_profile(
    model: str,
    explicit: str | None,
    cores: int | None = None,
    cache_home: str | None = None,
    worker_args: list[str] | None = None,
    run=subprocess.run,
) -> str:
    """The path of the profile to plan with (see the module doc); SystemExit when a measurement fails."""
    if explicit:
        return explicit
    shipped = shipped_profile(model)
    if shipped is not None:
        say(
            f"using the capacity profile shipped for {model} ({_describe(shipped)}); "
            "for this machine's own: `splitserve profile --out F`, then --profile F"
        )
        return str(shipped)
    cached = cache_path(model, cores or os.cpu_count() or 1, cache_home)
    if cached.is_file():
        say(f"using the capacity profile measured earlier on this machine: {cached}")
        return str(cached)
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".partial")
    say(
        f"no capacity profile for {model}: measuring one on this machine (a short sweep, about a minute "
        f"or two); it is cached in {cached}"
    )
    argv = [
        sys.executable,
        "-m",
        "splitserve.platform.cli",
        "profile",
        "--model",
        model,
        "--out",
        str(partial),
        *QUICK_SWEEP,
        *(worker_args or []),
    ]
    result = run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise SystemExit(
            f"up --planner: measuring a capacity profile for {model} failed "
            f"(exit {result.returncode}):\n{(result.stderr or '')[-2000:]}\n"
            "pass one with --profile PROFILE.json (`splitserve profile`)"
        )
    partial.replace(cached)
    say(f"capacity profile measured and cached: {cached}")
    return str(cached)
