"""The package's layering (docs/architecture.md): every import inside horolite/ and the
launcher (installed as horolite.launcher from launcher/), lazy ones included, goes to the
same layer or a lower one, and no modules import each other in a circle."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "horolite")
LAUNCHER = os.path.join(ROOT, "launcher")

# Lowest first. A module may import its own layer and those below it, never one above.
LAYERS = [
    ("horolite.errors", "horolite.version", "horolite._native", "horolite.core"),
    ("horolite.failure", "horolite.transport", "horolite.world"),
    ("horolite.coordination",),
    ("horolite.execution",),
    ("horolite.runtime",),
    ("horolite.api", "horolite.device", "horolite"),
    ("horolite.elastic",),
    ("horolite.tensorflow", "horolite.keras", "horolite.launcher"),
    ("horolite.ray",),
]


def layer_of(module: str) -> int:
    best, level = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    assert level is not None, module
    return level


def modules():
    found = {}
    for top, package in ((PKG, "horolite"), (LAUNCHER, "horolite.launcher")):
        for dirpath, _, files in os.walk(top):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    rel = os.path.relpath(path, top)[:-3].replace(os.sep, ".")
                    rel = package + "." + rel
                    is_pkg = rel.endswith(".__init__")
                    found[rel[: -len(".__init__")] if is_pkg else rel] = (path, is_pkg)
    return found


def imports_of(name, path, is_pkg, known):
    """Every horolite module `name` imports, at the top or inside a function."""
    package = name if is_pkg else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for t in targets:
            if not t.startswith("horolite"):
                continue
            while t not in known and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in known and t != name:
                out.add(t)
    return out


@pytest.fixture(scope="module")
def graph():
    known = modules()
    known_names = set(known) | {"horolite._native"}
    return {name: imports_of(name, path, is_pkg, known_names) for name, (path, is_pkg) in known.items()}


def test_no_import_goes_up_a_layer(graph):
    upward = [f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
              for m, targets in graph.items() for t in sorted(targets)
              if t not in ("horolite",) and layer_of(t) > layer_of(m)]
    # a subpackage's __init__ importing its own package's parent is not a dependency
    assert upward == []


def test_only_the_adapters_import_the_top_level_package(graph):
    # `horolite/__init__` re-exports the API; modules below it must import what they use
    # from where it lives, or importing one of them would run the whole package.
    below = [m for m, targets in graph.items() if "horolite" in targets and layer_of(m) < 5]
    assert below == []


def test_no_import_circles(graph):
    edges = {m: {t for t in ts if t != "horolite"} for m, ts in graph.items()}
    # a package's __init__ that re-exports from its modules is not a circle with them
    for m in list(edges):
        edges[m] = {t for t in edges[m] if not m.startswith(t + ".")}
    state, stack, circles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                circles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert circles == []


def test_the_layers_name_every_module(graph):
    for m in graph:
        layer_of(m)
