"""Import layering (docs/architecture.md, "Layers"), checked on the source with `ast`.

import-linter cannot be used here: its graph builder (grimp) needs the root package to be a
regular package on sys.path, and ours is mapped from several folders with package-dir, two of
which (platform/, operator/) must stay namespace packages. So this builds the same graph:
every module's imports, followed transitively through our own modules.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {
    "platform": "splitserve.platform",
    "workers": "splitserve.workers",
    "router": "splitserve.router",
    "operator": "splitserve.operator",
    "planner": "splitserve.planner",
    "rayserve": "splitserve.rayserve",
    "launch": "splitserve.launch",
    "bench/loadgen": "splitserve.bench.loadgen",
}  # bench/'s scripts are not in the package
SERVING = [
    "splitserve.platform",
    "splitserve.workers",
    "splitserve.router",
    "splitserve.operator",
    "splitserve.planner",
]

# The layers, lowest first: a package imports only packages of a lower layer (never one beside or
# above it). The planner is a torch-free control-plane library: the router (`up --planner`), the
# workers (`splitserve profile` measures its CapacityProfile) and the operator build on it.
# The launchers (`splitserve up`) and the Ray Serve layer each compose router and workers.
LAYERS = [
    ["splitserve.platform"],
    ["splitserve.planner", "splitserve.bench.loadgen"],
    ["splitserve.workers", "splitserve.router", "splitserve.operator"],
    ["splitserve.rayserve", "splitserve.launch"],
]

# The router's own layers, lowest first, by the same rule (docs/architecture.md, "router/"): the
# settings, errors and usage record every folder shares; the subsystems (where a request goes, its
# queue, who may ask); core/, one request from admission to the last chunk; router.py, those pieces
# assembled; api/, the HTTP edge (the one user of FastAPI); main.py (`splitserve router`); and epp/,
# the inference-gateway processes built on all of it. A subsystem raises router/errors.py's errors
# and api/ answers them, so no lower folder imports a higher one to report a failure.
ROUTER_LAYERS = [
    [
        "splitserve.router.errors",
        "splitserve.router.usage",
        "splitserve.router.config",
        "splitserve.router.logctx",
        "splitserve.router.metrics",
    ],
    ["splitserve.router.placement", "splitserve.router.flow", "splitserve.router.tenancy"],
    ["splitserve.router.core"],
    ["splitserve.router.router"],
    ["splitserve.router.api"],
    ["splitserve.router.main"],
    ["splitserve.router.epp"],
]
BELOW_THE_EDGE = [pkg for layer in ROUTER_LAYERS[:3] for pkg in layer]

# (source modules, forbidden modules): a forbidden module must not be reachable from a source.
ENGINE = [
    "splitserve.platform.engine",
    "splitserve.platform.models",
    "splitserve.platform.kv",
    "splitserve.platform.sched",
    "splitserve.platform.weights",
    "splitserve.platform.sampling.sampler",
]
CONTRACTS = [
    (
        "platform imports nothing else of ours",
        ["splitserve.platform"],
        ["splitserve.workers", "splitserve.router", "splitserve.operator"],
    ),
    ("workers do not import router or operator", ["splitserve.workers"], ["splitserve.router", "splitserve.operator"]),
    (
        "router never imports torch nor the engine",
        ["splitserve.router"],
        ["torch", "splitserve.workers", "splitserve.operator", *ENGINE],
    ),
    (
        "operator imports only shared config",
        ["splitserve.operator"],
        ["torch", "splitserve.workers", "splitserve.router", "splitserve.platform.tokenizer", *ENGINE],
    ),
    (
        "shared modules stay torch-free",
        [
            "splitserve.platform.hashing",
            "splitserve.platform.tokenizer",
            "splitserve.platform.config",
            "splitserve.platform.settings",
            "splitserve.platform.model_source",
            "splitserve.platform.formats",
            "splitserve.platform.engine.detokenizer",
            "splitserve.platform.engine.stop",
            "splitserve.platform.observability.tracing",
            "splitserve.platform.observability.logfmt",
        ],
        ["torch"],
    ),
    # The planner runs in its own small pod and inside `splitserve up`: control law only.
    (
        "the planner imports only shared config",
        ["splitserve.planner"],
        [
            "torch",
            "splitserve.workers",
            "splitserve.router",
            "splitserve.operator",
            "splitserve.platform.tokenizer",
            *ENGINE,
        ],
    ),
    # rayserve/ composes router and workers for Ray Serve (rayserve/__init__.py): it may import
    # both, nothing of ours imports it, and only the replica (in its own Ray process) loads the
    # engine; the driver, the ingress and the policy the Serve controller imports stay torch-free.
    ("nothing of ours imports the Ray Serve layer", [*SERVING, "splitserve.bench.loadgen"], ["splitserve.rayserve"]),
    (
        "the Ray Serve driver and ingress never load the engine",
        [
            "splitserve.rayserve.config",
            "splitserve.rayserve.serve",
            "splitserve.rayserve.ingress",
            "splitserve.rayserve.registry",
            "splitserve.rayserve.discovery",
            "splitserve.rayserve.autoscale",
            "splitserve.rayserve.placement",
        ],
        ["torch", "splitserve.workers", "splitserve.rayserve.replica", *ENGINE],
    ),
    (
        "the Ray Serve autoscaling policy imports nothing of ours",
        ["splitserve.rayserve.autoscale"],
        ["torch", "splitserve.platform", "splitserve.workers", "splitserve.router"],
    ),
    # The load generator (`splitserve bench`) is an OpenAI-API client that must measure any server:
    # torch-free, platform's errors and tokenizer only. Only the bench scripts and tests import it.
    (
        "the load generator is a torch-free client",
        ["splitserve.bench.loadgen"],
        ["torch", "splitserve.workers", "splitserve.router", "splitserve.operator", "splitserve.planner", *ENGINE],
    ),
    (
        "nothing that serves imports the benchmark tools",
        [*SERVING, "splitserve.rayserve", "splitserve.launch"],
        ["splitserve.bench"],
    ),
    # launch/ (`splitserve up`) runs the router in its own process and starts each worker as a
    # child process: it never loads the engine itself, and nothing below it imports it.
    (
        "nothing of ours imports the launchers",
        [*SERVING, "splitserve.rayserve", "splitserve.bench.loadgen"],
        ["splitserve.launch"],
    ),
    ("the launchers start workers as processes and never load the engine", ["splitserve.launch"], ["torch", *ENGINE]),
    ("router core and the layers below it never import FastAPI", BELOW_THE_EDGE, ["fastapi", "starlette"]),
]


def module_files() -> dict[str, pathlib.Path]:
    mods = {}
    for folder, pkg in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = path
    return mods


def direct_imports(name: str, path: pathlib.Path) -> set[str]:
    out = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def _package(module: str, layers: list[list[str]]) -> str | None:
    for layer in layers:
        for pkg in layer:
            if module == pkg or module.startswith(pkg + "."):
                return pkg
    return None


def layer_violations(graph: dict[str, set[str]], layers: list[list[str]] | None = None) -> list[str]:
    """Direct imports of a package in the same layer or a higher one (`layers`: LAYERS by default)."""
    layers = LAYERS if layers is None else layers
    rank = {pkg: i for i, layer in enumerate(layers) for pkg in layer}
    problems = []
    for src in sorted(graph):
        src_pkg, reported = _package(src, layers), set()
        for imp in sorted(graph[src]):  # `from m import x` lists m and m.x: one line per package
            imp_pkg = _package(imp, layers)
            if src_pkg is None or imp_pkg is None or imp_pkg == src_pkg or imp_pkg in reported:
                continue
            if rank[imp_pkg] >= rank[src_pkg]:
                reported.add(imp_pkg)
                problems.append(f"layers: {src} imports {imp} ({imp_pkg} is not below {src_pkg})")
    return problems


def violations() -> list[str]:
    mods = module_files()
    graph = {m: direct_imports(m, p) for m, p in mods.items()}
    problems = layer_violations(graph) + layer_violations(graph, ROUTER_LAYERS)
    for module in sorted(m for m in mods if m.startswith("splitserve.router.")):
        if _package(module, ROUTER_LAYERS) is None:
            problems.append(f"router layers: {module} is in none of ROUTER_LAYERS")
    for title, sources, forbidden in CONTRACTS:
        for src in [m for m in mods if any(m == s or m.startswith(s + ".") for s in sources)]:
            chain = _find_forbidden(src, graph, forbidden)
            if chain:
                problems.append(f"{title}: {' -> '.join(chain)}")
    return problems


def _find_forbidden(src: str, graph: dict[str, set[str]], forbidden: list[str]) -> list[str] | None:
    stack, seen = [[src]], {src}
    while stack:
        path = stack.pop()
        for imp in sorted(graph.get(path[-1], ())):  # sorted: the same chain on every run
            if any(imp == f or imp.startswith(f + ".") for f in forbidden):
                return path + [imp]
            if imp in graph and imp not in seen:
                seen.add(imp)
                stack.append(path + [imp])
    return None


def import_cycles(graph: dict[str, set[str]], package: str) -> list[list[str]]:
    """The import circles among `package`'s modules (strongly connected components of more than one
    module, or a module importing itself), each sorted; imports under TYPE_CHECKING count too, since
    a circle there is the same knot for a reader. Iterative Tarjan, so deep chains do not recurse."""
    nodes = sorted(m for m in graph if m == package or m.startswith(package + "."))
    inside = set(nodes)
    edges = {m: sorted(i for i in graph[m] if i in inside) for m in nodes}
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    cycles.append(sorted(component))
    return cycles


# Shipped modules that nothing imports by design: run with `python -m` (proto/README.md).
PYTHON_M_TOOLS = {"splitserve.platform.wire.generate"}


def entry_point_modules(pyproject: dict) -> set[str]:
    """The modules pyproject's console scripts and entry points name (`module:function`)."""
    project = pyproject["project"]
    targets = [*project.get("scripts", {}).values()]
    for group in project.get("entry-points", {}).values():
        targets += group.values()
    return {target.split(":")[0] for target in targets}


def named_modules(path: pathlib.Path) -> set[str]:
    """Modules a file names in a string, as an import path does (Ray Serve's "pkg.module:attr")."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("splitserve."):
            name = node.value.split(":")[0]
            if name.replace(".", "").replace("_", "").isalnum():
                out.add(name)
    return out


def unimported_modules(roots: set[str]) -> list[str]:
    """Shipped modules (packages' __init__ aside) that no other shipped module imports or names,
    and that are not in `roots` (entry points, `python -m` tools): code only tests reach."""
    mods = module_files()
    reached = set(roots)
    for name, path in mods.items():
        reached |= {i for i in direct_imports(name, path) | named_modules(path) if i != name}
    return sorted(m for m, p in mods.items() if p.name != "__init__.py" and m not in reached)
