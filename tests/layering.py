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
            "splitserve.platform.detokenizer",
            "splitserve.platform.stop",
            "splitserve.platform.tracing",
            "splitserve.platform.logfmt",
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


def _package(module: str) -> str | None:
    for layer in LAYERS:
        for pkg in layer:
            if module == pkg or module.startswith(pkg + "."):
                return pkg
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Direct imports of a package in the same layer or a higher one."""
    rank = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
    problems = []
    for src in sorted(graph):
        src_pkg, reported = _package(src), set()
        for imp in sorted(graph[src]):  # `from m import x` lists m and m.x: one line per package
            imp_pkg = _package(imp)
            if src_pkg is None or imp_pkg is None or imp_pkg == src_pkg or imp_pkg in reported:
                continue
            if rank[imp_pkg] >= rank[src_pkg]:
                reported.add(imp_pkg)
                problems.append(f"layers: {src} imports {imp} ({imp_pkg} is not below {src_pkg})")
    return problems


def violations() -> list[str]:
    mods = module_files()
    graph = {m: direct_imports(m, p) for m, p in mods.items()}
    problems = layer_violations(graph)
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
