"""The import graph of the ``fp8lab`` package: no cycle, and imports only point down the views.

Every module under ``fp8lab/`` is parsed with ``ast`` (not imported); every ``import`` and ``from ... import``
of an ``fp8lab`` module, at module level or inside a function, absolute or relative, is an edge to the
module it names (``from pkg import name`` names the submodule ``pkg.name`` when there is one). The rules
(ARCHITECTURE.md, "Layout"):

- no cycle, lazy (function-level) imports included: a circle is a design knot even when it happens to
  import in some order;
- ``reference`` imports nothing of fp8lab but ``reference``; ``simulators``: ``reference`` and itself;
  ``numba_kernels``: ``simulators``, ``reference`` and itself; ``engine`` anything but the command line;
  ``testing``: ``reference`` and itself; ``serve`` (the HTTP server): ``engine``, ``reference`` and itself;
  nothing imports ``engine`` but ``engine``, ``serve`` and the command line, nothing ``serve`` but itself
  and the command line;
- the top-level modules: ``fp8lab.cli`` (the ``fp8lab`` command: ``e4m3``, the kit's ``check``, the
  engine's subcommands, ``serve``) imports ``reference``, ``testing``, ``engine`` and ``serve``, and nothing
  imports it;
  ``fp8lab.pytest_plugin`` (loaded in every pytest run) imports nothing of fp8lab.

The cycle finder is checked on small synthetic graphs, so that the test can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fp8lab"

MAY_IMPORT = {
    "reference": {"reference"},
    "simulators": {"reference", "simulators"},
    "numba_kernels": {"reference", "simulators", "numba_kernels"},
    "engine": {"reference", "simulators", "numba_kernels", "engine"},
    "testing": {"reference", "testing"},  # the kit for other people's kernels: the oracle only (NumPy, Hypothesis)
    "serve": {"reference", "engine", "serve"},  # fp8lab serve: the HTTP server over the engine (aiohttp)
    "cli": {"reference", "testing", "engine", "serve"},  # fp8lab/cli.py, the command line (all but e4m3 lazily)
    "pytest_plugin": set(),  # fp8lab/pytest_plugin.py: the standard library and pytest only
}
"""The views (and top-level modules) each may import (top-level ``fp8lab`` itself imports nothing)."""


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``package`` (a package is its ``__init__``)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (in file ``path``) imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # ``from pkg import sub`` imports the submodule pkg.sub; ``from mod import name`` the module mod
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import a.b.c`` of a name inside a module: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the fp8lab modules it imports."""
    files = module_files(package)
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as ``[a, b, ..., a]``, or None when it has none (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def view_of(module: str) -> str | None:
    """The subpackage a module is in (``reference``, ..., ``testing``), or the top-level module's own name
    (``cli``, ``pytest_plugin``); None for ``fp8lab`` itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


# ---------------------------------------------------------------------------- the finder itself


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) is None  # a diamond is no cycle
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"a"}, "a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_relative_and_lazy_imports_are_edges(tmp_path):
    """A package with a circle through a function-level relative import, as ``engine/backend.py ->
    cuda_model -> model -> backend`` was: found."""
    pkg = tmp_path / "fp8lab" / "engine"
    (pkg / "cuda").mkdir(parents=True)
    for init in (tmp_path / "fp8lab", pkg, pkg / "cuda"):
        (init / "__init__.py").write_text("")
    (pkg / "backend.py").write_text("def load():\n    from .cuda.model import Model\n")
    (pkg / "cuda" / "model.py").write_text("from ..model import Batch\nfrom fp8lab.engine import config\n")
    (pkg / "model.py").write_text("from . import backend\n")
    (pkg / "config.py").write_text("import numpy\n")
    graph = import_graph(tmp_path / "fp8lab")
    assert graph["fp8lab.engine.cuda.model"] == {"fp8lab.engine.model", "fp8lab.engine.config"}
    assert graph["fp8lab.engine.model"] == {"fp8lab.engine.backend"}
    assert find_cycle(graph) == ["fp8lab.engine.backend", "fp8lab.engine.cuda.model", "fp8lab.engine.model",
                                 "fp8lab.engine.backend"]


# ---------------------------------------------------------------------------- the package


def test_the_package_graph_covers_every_view():
    graph = import_graph()
    assert {view_of(m) for m in graph} - {None} == set(MAY_IMPORT)  # a new top-level module needs its rule
    assert "fp8lab.engine.model" in graph["fp8lab.engine.cuda.model"]  # the parser sees relative imports


def test_fp8lab_imports_have_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("view", sorted(MAY_IMPORT))
def test_imports_point_down_the_views(view):
    graph = import_graph()
    bad = sorted(f"{module} imports {target}" for module, targets in graph.items() if view_of(module) == view
                 for target in targets if view_of(target) not in MAY_IMPORT[view])
    assert not bad, bad
