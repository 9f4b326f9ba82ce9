"""The import structure, read from the source with `ast` (nothing is imported): core/ and quant/
never import the command line, quant/ never imports core/, and no module imports itself back
through others. Every import statement counts: function-local ones, and those under
`if TYPE_CHECKING:` too (they keep a cycle from failing at import time, but the two modules still
depend on each other). Calls such as `importlib.import_module` are not import statements and are
not followed."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"cli": "brisk.cli", "core": "brisk.core", "quant": "brisk.quant"}  # folder -> installed name


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the three packages (a package is its __init__)."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that the file imports, relative imports resolved, with the packages
    whose __init__ runs on the way."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def add(target: str, names=()):
        for n in names:  # `from pkg import mod` imports the module pkg.mod
            if f"{target}.{n}" in known:
                found.add(f"{target}.{n}")
            elif target in known:
                found.add(target)
        if not names:  # `import a.b.c`: the deepest known module it names
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target:
                found.add(target)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            add(target, [alias.name for alias in node.names])
    for target in list(found):  # importing a.b.c runs a.b's __init__ first, unless a.b is being imported
        parent = target.rpartition(".")[0]
        while parent:
            if parent in known and not (name == parent or name.startswith(parent + ".")):
                found.add(parent)
            parent = parent.rpartition(".")[0]
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a, b, ..., a) through each strongly connected group of modules (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, within the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in {group}")  # cannot happen: the group is strongly connected


def test_the_graph_is_read_as_python_resolves_it():
    graph = import_graph()
    assert {"brisk.cli.main", "brisk.core.errors", "brisk.quant.formats"} <= graph.keys()
    assert "brisk.core.errors" in graph["brisk.core.sampling_params"]  # from .errors import ...
    assert "brisk.cli.app" in graph["brisk.cli.main"]  # from .app import app
    assert "brisk.core.benchmark" in graph["brisk.cli.bench_cmd"]  # from ..core import benchmark (in a function)
    assert "brisk.core" in graph["brisk.cli.bench_cmd"]  # its __init__ runs first
    assert "brisk.core" not in graph["brisk.core.sampling_params"]  # ... but not for its own modules
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


# the layers: the command line over core over quant; none imports a layer above it
FORBIDDEN = {"brisk.core": ("brisk.cli",), "brisk.quant": ("brisk.cli", "brisk.core")}


def test_core_and_quant_never_import_a_layer_above():
    graph = import_graph()
    bad = [f"{m} imports {t}" for m, targets in sorted(graph.items()) for t in sorted(targets)
           for layer, above in FORBIDDEN.items()
           if (m == layer or m.startswith(layer + ".")) and any(t == a or t.startswith(a + ".") for a in above)]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
