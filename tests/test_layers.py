"""The package's layers depend one way: each stage imports only the stages before it.

format → plan → io → codecs → pipeline → handoff → adapters → (prepare, checkpoints, calc, doctor) →
server → bench. Imports are read from the source (top-level and function-level alike), so a lazy
import that points the wrong way fails here too.
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# layer of each package or module (lower may not import higher)
LAYERS = {
    "gdsload.loader.errors": 0,
    "gdsload.loader.version": 0,
    "gdsload.loader.config": 0,
    "gdsload.loader.dtypes": 0,
    "gdsload.loader.driver": 0,
    "gdsload.loader.devices": 1,
    "gdsload.loader.format": 2,
    "gdsload.loader.model_config": 2,
    "gdsload.loader.plan": 3,
    "gdsload.loader.io": 4,
    "gdsload.loader.codecs": 5,
    "gdsload.loader.pipeline": 6,
    "gdsload.loader.handoff": 7,
    "gdsload.loader.adapters": 8,
    "gdsload.loader.prepare": 9,
    "gdsload.loader.checkpoints": 9,
    "gdsload.loader.calc": 9,
    "gdsload.loader.doctor": 9,
    "gdsload.loader": 10,  # the package's lazy public names
    "gdsload": 10,  # the top-level package (loader/_toplevel): gdsload.save / gdsload.load, lazily
    "gdsload.server": 11,
    "gdsload.bench": 12,
}
# Known, deliberate exceptions: (importer, imported) with the reason.
ALLOWED: dict[tuple[str, str], str] = {}


def _layer(module: str) -> tuple[str, int] | None:
    best = None
    for name, layer in LAYERS.items():
        if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[0])):
            best = (name, layer)
    return best


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    if rel.parts[:2] == ("loader", "_toplevel"):  # installed as the package gdsload itself
        return ".".join(["gdsload", *rel.parts[2:]]).removesuffix(".__init__")
    parts = list(rel.parts)
    parts[0] = {"loader": "gdsload.loader", "server": "gdsload.server", "bench": "gdsload.bench"}[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _all_modules() -> dict[str, Path]:
    return {_module_of(path): path for top in ("loader", "server", "bench") for path in (ROOT / top).rglob("*.py")}


def _targets(node: ast.AST, pkg: str, modules: Collection[str]) -> list[str]:
    """The modules an import statement names: ``from .. import driver`` names the module ``driver``, not its package."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        parts = pkg.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def _imports(path: Path, module: str, modules: Collection[str]) -> set[str]:
    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = {t for node in ast.walk(ast.parse(path.read_text())) for t in _targets(node, pkg, modules)}
    return {m for m in out if m.startswith("gdsload.")}


def test_every_import_points_down_the_layers():
    wrong = []
    modules = _all_modules()
    for module, path in modules.items():
        mine = _layer(module)
        assert mine is not None, module
        for imported in _imports(path, module, modules):
            theirs = _layer(imported)
            if theirs is None or theirs[0] == mine[0]:
                continue
            if theirs[1] > mine[1] and (mine[0], theirs[0]) not in ALLOWED:
                wrong.append(f"{module} imports {imported} ({mine[0]} is below {theirs[0]})")
    assert not wrong, "\n".join(sorted(wrong))


def test_imports_inside_the_package_are_relative():
    """``from ..format.safetensors import read_header`` in ``loader/io/``: the folder each import comes from is on
    the page (``loader/format/``), for a reader and for a tool that does not know the packaging table. The top-level
    package (``loader/_toplevel``, installed as ``gdsload``) is the exception: its folder is not its package's."""
    absolute = []
    for module, path in _all_modules().items():
        if "_toplevel" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            absolute += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.startswith("gdsload.")]
    assert not absolute, "\n".join(absolute)


def _module_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports (a ``from pkg import name`` counts as the
    submodule ``pkg.name`` where that is a module, else as ``pkg`` itself)."""
    modules = _all_modules()
    return {module: _imports(path, module, modules) & set(modules) - {module} for module, path in modules.items()}


def test_no_module_imports_itself_back():
    """No import circles, lazy imports included: a circle means neither module can be read (or tested) alone."""
    graph = _module_graph()
    # Tarjan's strongly connected components
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(" ↔ ".join(c) for c in circles)
