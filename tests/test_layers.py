"""The layering of docs/architecture.md, read from the source: the import graph of jax_fa3 is
acyclic and every import points down the layers. Imports inside functions count (a late
import hides a cycle, it does not remove it). CPU only, nothing is imported."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jax_fa3"

# docs/architecture.md, lowest first: a module may import only modules of lower layers.
LAYERS = [
    ("jax_fa3._masks", "jax_fa3._validate", "jax_fa3._vma", "jax_fa3._ffi"),
    ("jax_fa3.segments",),
    ("jax_fa3._ops", "jax_fa3.portable"),
    ("jax_fa3.portable_fp8",),
    ("jax_fa3._core",),
    ("jax_fa3.ring",),
    ("jax_fa3.sharding",),
    ("jax_fa3.attention",),
    ("jax_fa3.compat", "jax_fa3.fp8"),
    ("jax_fa3",),
]


def _modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the package (packages by their __init__)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(path: pathlib.Path, modules: dict) -> set[str]:
    """The jax_fa3 modules that the file imports, anywhere in it. `from X import y` depends
    on X.y when that is a module, else on X (y is a name defined there)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return {name for name in out if name in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _cycle(graph) -> list[str] | None:
    """One import cycle (as a path that returns to its start), or None."""
    state = {}  # name -> "open" while on the DFS stack, "done" after

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":  # on the current path: a cycle
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_graph_is_read():
    """The walk sees the imports it must see (a broken walk would pass the checks below)."""
    graph = _graph()
    assert {"jax_fa3._core", "jax_fa3.sharding"} <= graph["jax_fa3.attention"]
    assert "jax_fa3._ops" in graph["jax_fa3._core"]
    assert "jax_fa3.nn.rope" in graph["jax_fa3.nn"]


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("layer", range(len(LAYERS)), ids=[ls[0] for ls in LAYERS])
def test_imports_point_down_the_layers(layer):
    graph = _graph()
    rank = {name: i for i, names in enumerate(LAYERS) for name in names}
    for module in LAYERS[layer]:
        up = sorted(m for m in graph[module] if rank.get(m, len(LAYERS)) >= layer)
        assert not up, f"{module} imports {up}, which are not below it"


def test_every_module_has_a_layer():
    """A new module gets a place in LAYERS (and in docs/architecture.md)."""
    placed = {name for names in LAYERS for name in names}
    missing = sorted(m for m in _graph() if m not in placed and not m.startswith("jax_fa3.nn"))
    assert not missing, f"modules without a layer: {missing}"
