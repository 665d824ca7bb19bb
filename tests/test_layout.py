"""The repository layout: no stdlib shadowing, and the layering of docs/architecture.md."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_py(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_root_does_not_shadow_stdlib_platform_and_operator():
    out = run_py("import platform, operator; print(platform.__file__); print(operator.__file__)")
    for line in out.split():
        assert str(ROOT) not in line, f"{line} resolves into the repository"
        assert "lib/python3" in line
    assert not (ROOT / "platform" / "__init__.py").exists()
    assert not (ROOT / "operator" / "__init__.py").exists()
    # ...and the stdlib modules still work while our package is importable from the root.
    out = run_py(
        "import platform, splitserve.platform.config as c, splitserve.operator.constants as k;"
        "print(platform.system(), c.__file__, k.API_GROUP)"
    )
    assert str(ROOT / "platform" / "config.py") in out
    assert "serving.splitserve.io" in out


def test_import_layering_contracts():
    from layering import violations

    assert violations() == []


def test_layering_checker_catches_a_violation(tmp_path, monkeypatch):
    import layering

    bad = tmp_path / "router"
    bad.mkdir()
    (bad / "placement.py").write_text(
        "from splitserve.platform import tokenizer\nimport splitserve.platform.kv.manager\n"
    )
    monkeypatch.setattr(layering, "ROOT", tmp_path)
    monkeypatch.setattr(layering, "FOLDERS", {"router": "splitserve.router"})
    assert layering.violations() == [
        "router never imports torch nor the engine: splitserve.router.placement -> splitserve.platform.kv.manager"
    ]


def test_layering_checker_catches_ray_and_load_generator_violations(tmp_path, monkeypatch):
    import layering

    for rel, code in {
        "router/api/app.py": "import splitserve.rayserve.registry\n",
        "rayserve/ingress.py": "from splitserve.rayserve.replica import build_pool\n",
        "rayserve/replica.py": "import torch\n",
        "bench/loadgen/client.py": "import splitserve.router.config\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(code)
    monkeypatch.setattr(layering, "ROOT", tmp_path)
    monkeypatch.setattr(
        layering,
        "FOLDERS",
        {"router": "splitserve.router", "rayserve": "splitserve.rayserve", "bench/loadgen": "splitserve.bench.loadgen"},
    )
    assert sorted(layering.violations()) == [
        "layers: splitserve.bench.loadgen.client imports splitserve.router.config (splitserve.router is not below "
        "splitserve.bench.loadgen)",
        "layers: splitserve.router.api.app imports splitserve.rayserve.registry (splitserve.rayserve is not below "
        "splitserve.router)",
        "nothing of ours imports the Ray Serve layer: splitserve.router.api.app -> splitserve.rayserve.registry",
        "the Ray Serve driver and ingress never load the engine: splitserve.rayserve.ingress -> "
        "splitserve.rayserve.replica",
        "the load generator is a torch-free client: splitserve.bench.loadgen.client -> splitserve.router.config",
    ]


def test_layering_checker_keeps_the_planner_below_router_workers_and_operator(tmp_path, monkeypatch):
    import layering

    for rel, code in {
        "planner/law.py": "from splitserve.router.config import RouterConfig\n",
        "launch/up_planner.py": "from splitserve.planner.law import Planner\n",
        "workers/profile.py": "from splitserve.planner.profile import CapacityProfile\n",
        "operator/render_planner.py": "import splitserve.planner.config\n",
        "workers/main.py": "import splitserve.router.app\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(code)
    monkeypatch.setattr(layering, "ROOT", tmp_path)
    monkeypatch.setattr(
        layering, "FOLDERS", {f: f"splitserve.{f}" for f in ("planner", "router", "workers", "operator", "launch")}
    )
    problems = layering.layer_violations({m: layering.direct_imports(m, p) for m, p in layering.module_files().items()})
    assert problems == [
        "layers: splitserve.planner.law imports splitserve.router.config (splitserve.router is not below "
        "splitserve.planner)",
        "layers: splitserve.workers.main imports splitserve.router.app (splitserve.router is not below "
        "splitserve.workers)",
    ]


def test_layering_checker_keeps_the_router_folders_in_order(tmp_path, monkeypatch):
    """The router's own layers: a subsystem importing the API layer (or a folder beside it) or core
    importing FastAPI is reported, an import downwards is not, and a module outside every layer is."""
    import layering

    for rel, code in {
        "router/placement/placer.py": "from splitserve.router.api.errors import APIError\n",
        "router/placement/scorers.py": "import splitserve.router.flow.controller\n",
        "router/tenancy/quota.py": "from splitserve.router.core.usage import Usage\n",
        "router/core/respond.py": "from fastapi import Request\n",
        "router/api/app.py": "from splitserve.router.core import pipeline\nfrom splitserve.router.errors import APIError\n",
        "router/epp/main.py": "import splitserve.router.main\nimport splitserve.router.api.app\n",
        "router/errors.py": "import math\n",
        "router/extra.py": "import json\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(code)
    monkeypatch.setattr(layering, "ROOT", tmp_path)
    monkeypatch.setattr(layering, "FOLDERS", {"router": "splitserve.router"})
    assert layering.violations() == [
        "layers: splitserve.router.placement.placer imports splitserve.router.api.errors (splitserve.router.api "
        "is not below splitserve.router.placement)",
        "layers: splitserve.router.placement.scorers imports splitserve.router.flow.controller "
        "(splitserve.router.flow is not below splitserve.router.placement)",
        "layers: splitserve.router.tenancy.quota imports splitserve.router.core.usage (splitserve.router.core "
        "is not below splitserve.router.tenancy)",
        "router layers: splitserve.router.extra is in none of ROUTER_LAYERS",
        "router core and the layers below it never import FastAPI: splitserve.router.core.respond -> fastapi",
    ]


def test_every_shipped_module_is_used_outside_the_tests():
    """A module that only tests import is dead weight in the wheel: delete it or move it under tests/."""
    import tomllib

    import layering

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    roots = layering.entry_point_modules(pyproject) | layering.PYTHON_M_TOOLS
    assert layering.unimported_modules(roots) == []


def test_unused_module_finder_sees_imports_import_paths_and_entry_points(tmp_path, monkeypatch):
    import layering

    for rel, code in {
        "platform/a.py": "from splitserve.platform import b\n",
        "platform/b.py": "import json\n",
        "platform/dead.py": "import splitserve.platform.dead\n",  # importing itself does not count
        "platform/sub/__init__.py": "",
        "platform/sub/served.py": "x = 1\n",
        "platform/sub/cli.py": "APP = 'splitserve.platform.sub.served:build'\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(code)
    monkeypatch.setattr(layering, "ROOT", tmp_path)
    monkeypatch.setattr(layering, "FOLDERS", {"platform": "splitserve.platform"})
    pyproject = {"project": {"entry-points": {"splitserve.commands": {"x": "splitserve.platform.sub.cli:register"}}}}
    roots = layering.entry_point_modules(pyproject)
    assert layering.unimported_modules(roots) == ["splitserve.platform.a", "splitserve.platform.dead"]


def test_platform_root_keeps_at_most_six_modules():
    """platform/'s root holds what every layer shares; the rest lives in a subpackage named for its job."""
    root = sorted(p.name for p in (ROOT / "platform").glob("*.py"))
    assert len(root) <= 6, root


# Packages whose modules import one another without a circle (TYPE_CHECKING imports included).
ACYCLIC = [
    "splitserve.platform",
    "splitserve.workers",
    "splitserve.router",
    "splitserve.launch",
    "splitserve.operator",
    "splitserve.planner",
    "splitserve.rayserve",
    "splitserve.bench.loadgen",
]


def test_no_import_cycle_in_any_package():
    from layering import direct_imports, import_cycles, module_files

    graph = {m: direct_imports(m, p) for m, p in module_files().items()}
    assert {pkg: import_cycles(graph, pkg) for pkg in ACYCLIC} == {pkg: [] for pkg in ACYCLIC}


MAX_FUNCTION_LINES = 60
SMALL_FUNCTIONS = ["workers"]  # folders whose every function (and method) fits on a screen


def long_functions(folder: pathlib.Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`path:line name (N lines)` of each function or method in `folder` longer than `limit`
    lines, decorators and docstring included."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = node.end_lineno - first + 1
                if length > limit:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_over_60_lines():
    assert {folder: long_functions(ROOT / folder) for folder in SMALL_FUNCTIONS} == {f: [] for f in SMALL_FUNCTIONS}


def test_long_function_finder_counts_decorators_and_bodies(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    body = "".join(f"    x{i} = {i}\n" for i in range(58))
    # fits: decorator + def + 58 lines = 60; over: def + 59 lines + return = 61 (from line 63)
    (tmp_path / "m.py").write_text(f"@dec\ndef fits():\n{body}\n\nasync def over():\n{body}    y = 0\n    return y\n")
    assert long_functions(tmp_path) == ["m.py:63 over (61 lines)"]
    assert long_functions(tmp_path, 59) == ["m.py:2 fits (60 lines)", "m.py:63 over (61 lines)"]


def test_cycle_finder_reports_each_circle_once(tmp_path, monkeypatch):
    import layering

    for rel, code in {
        "platform/a.py": "from splitserve.platform import b\n",
        "platform/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from splitserve.platform.c import X\n",
        "platform/c.py": "import splitserve.platform.a\nimport splitserve.platform.d\n",
        "platform/d.py": "import json\n",
        "platform/e.py": "import splitserve.platform.e\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(code)
    monkeypatch.setattr(layering, "ROOT", tmp_path)
    monkeypatch.setattr(layering, "FOLDERS", {"platform": "splitserve.platform"})
    graph = {m: layering.direct_imports(m, p) for m, p in layering.module_files().items()}
    assert sorted(layering.import_cycles(graph, "splitserve.platform")) == [
        ["splitserve.platform.a", "splitserve.platform.b", "splitserve.platform.c"],
        ["splitserve.platform.e"],
    ]


def test_torch_free_modules_do_not_import_torch():
    out = run_py(
        "import sys, splitserve.platform.hashing, splitserve.platform.config, "
        "splitserve.platform.model_source, splitserve.platform.tokenizer, "
        "splitserve.platform.sampling.params; print('torch' in sys.modules)"
    )
    assert out.strip() == "False"


def test_every_package_folder_is_declared_in_pyproject():
    import tomllib

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        "platform": "splitserve.platform",
        "workers": "splitserve.workers",
        "router": "splitserve.router",
        "operator": "splitserve.operator",
        "planner": "splitserve.planner",
        "rayserve": "splitserve.rayserve",
        "launch": "splitserve.launch",
        "bench": "splitserve.bench",
    }
    for folder, pkg in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join([pkg, *rel.parts]) if rel.parts else pkg
            assert name in declared, f"{name} is missing from [tool.setuptools].packages"


def architecture_rows(doc: str) -> dict[str, set[str]]:
    """folder -> the module names in the first column of the tables of its `## <folder>/` section."""
    rows: dict[str, set[str]] = {}
    folder = None
    for line in doc.splitlines():
        if line.startswith("## "):
            head = line[3:].split(" ", 1)[0]
            folder = head.rstrip("/") if head.endswith("/") else None
            continue
        if folder is not None and line.startswith("| `"):
            first_cell = line.split("|")[1]
            rows.setdefault(folder, set()).update(first_cell.split("`")[1::2])
    return rows


def test_architecture_doc_lists_every_module():
    """Each module has a row in the section of *its* folder: a `profile.py` row under planner/
    does not stand for workers/profile.py."""
    rows = architecture_rows((ROOT / "docs" / "architecture.md").read_text())
    for folder in ("platform", "workers", "router", "operator", "planner", "rayserve", "launch", "bench/loadgen"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).as_posix()
            if path.name == "__init__.py" and path.stat().st_size == 0:
                continue
            assert rel in rows.get(folder, set()), f"docs/architecture.md's {folder}/ section has no row for {rel}"


def test_the_wheel_ships_every_package_and_command_but_no_bench_script(tmp_path):
    """What `pip install splitserve` gets: each package of pyproject with its modules, a module
    behind every `splitserve` subcommand, and of bench/ only the load generator (the scripts
    beside it are run from a checkout, `python bench/x.py`)."""
    import configparser
    import tomllib
    import zipfile

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    [wheel] = tmp_path.glob("splitserve-*.whl")
    zf = zipfile.ZipFile(wheel)
    names = set(zf.namelist())
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for pkg in setuptools["packages"]:
        folder = next(
            ROOT / d / pkg[len(p) :].lstrip(".").replace(".", "/")
            for p, d in sorted(setuptools["package-dir"].items(), key=lambda kv: -len(kv[0]))
            if pkg == p or pkg.startswith(p + ".")
        )
        for module in folder.glob("*.py"):
            assert f"{pkg.replace('.', '/')}/{module.name}" in names, f"{module} is not in the wheel"
    [ep_file] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    entry_points = configparser.ConfigParser()
    entry_points.read_string(zf.read(ep_file).decode())
    for command, target in entry_points["splitserve.commands"].items():
        module = target.split(":")[0].replace(".", "/") + ".py"
        assert module in names, f"`splitserve {command}` points at {target}, which is not in the wheel"
    assert {"bench", "serve"} <= set(entry_points["splitserve.commands"])
    assert "splitserve/bench/loadgen/cli.py" in names
    assert not [n for n in names if n.startswith("splitserve/bench/") and n.count("/") == 2], (
        "a bench/ script is in the wheel"
    )


def test_no_router_module_is_over_300_lines():
    """A gateway module owns one job; past 300 lines it is split by phase (docs/architecture.md)."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "router").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 300
    }
    assert long == {}


def test_the_engine_class_stays_a_wiring_of_parts():
    """llm_engine.py wires the parts assembly.py builds and routes requests through them; work
    that grows it (KV staging, P/D, tensor parallelism) belongs in a part of its own."""
    assert len((ROOT / "platform/engine/llm_engine.py").read_text().splitlines()) < 300
