"""The package layout is the data flow: each layer imports only from the layers below it.

Every import counts: module level, inside functions, and type-only imports under
``TYPE_CHECKING``. Within one layer, modules may import each other, but no module graph has a
circle. No module is over 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "sdadapt"

LAYERS: list[tuple[str, ...]] = [
    ("sdadapt._base", "sdadapt.errors"),  # regions, dtypes, report records, agreement; the exceptions
    ("sdadapt.sources",),  # checkpoint formats, the Hub, joined and LoRA sources, JSON
    ("sdadapt._recipes",),  # node kinds and the pure tensor functions they compute with
    ("sdadapt.rules",),  # every rule kind, built-in and user, and their constructors
    ("sdadapt._plan",),  # adapter, plan, report, target; which adapter a name or model means
    ("sdadapt._engine",),  # I/O, staging, the device lane, the DCP storage reader
    ("sdadapt._transaction",),  # load, training state, export, verify, shrink, diff
    ("sdadapt._draft", "sdadapt.torchtitan"),  # drafting adapters; the torchtitan bridge
    ("sdadapt", "sdadapt.cli", "sdadapt.__main__"),  # the public face and the command line
]
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    best, floor = -1, -1
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), i
    assert floor >= 0, f"{module} belongs to no layer; add it to LAYERS"
    return floor


def imports_of(module: str) -> set[str]:
    """The sdadapt modules ``module`` imports, resolved: ``from .x import y`` counts ``x.y``
    when that is a module, else ``x``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in MODULES else origin for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # ``import sdadapt.x.y`` names module x.y
                name = name.rpartition(".")[0]
            if name.startswith("sdadapt") and name != module:
                found.add(name)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_belongs_to_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_import_runs_up_a_layer():
    upward = [
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, targets in GRAPH.items()
        for t in sorted(targets)
        if layer_of(t) > layer_of(m) and not (m == "sdadapt" and t.startswith("sdadapt."))
    ]
    assert upward == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    # a package's __init__ importing its own submodules is how a package shows its face; its
    # submodules import each other directly, never their package's __init__
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in GRAPH.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_is_at_most_600_lines(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines"
