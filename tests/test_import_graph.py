"""The files of the package import each other without a cycle: read from the source with ``ast``, not by importing.

What counts as an edge from the importing file to the imported one:

- every ``import`` and ``from ... import`` of a module of the package (absolute ``fusedmoe.*`` or relative), at
  module level or inside a function or class: an import inside a function that goes back up is still a cycle
  of the layering, only a deferred one;
- but not one under ``if TYPE_CHECKING:`` (it never runs; the ``else:`` branch of such an ``if`` does count);
- ``from pkg import name``: an edge to the submodule ``pkg.name`` when there is one (``pkg/name.py`` or
  ``pkg/name/__init__.py``); otherwise to ``pkg``'s own file (``pkg.py``, or ``pkg/__init__.py``, which then
  defines, re-exports or, through a module ``__getattr__``, serves ``name``);
- ``import a.b`` and ``from a.b import name`` reach ``a.b`` only, not the packages above it. Python runs
  ``a/__init__.py`` first, but counting that would put every module in a cycle with ``fusedmoe/__init__.py``,
  which imports most of them.

So a package ``__init__`` importing its submodules is fine, and so is a submodule importing a sibling through the
package (``from . import sibling`` is an edge to the sibling). A submodule importing a name from its own package's
``__init__`` (``from . import Name``, ``from fusedmoe import route``) is an edge into that ``__init__``: a cycle
when the ``__init__`` imports the submodule, which works only as long as the ``__init__`` binds the name before
it imports the submodule. Imports by string (``importlib.import_module``) are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

#: (imported module, importing module, line of the import)
Edge = tuple[str, str, int]


def module_files(src: Path = SRC, package: str = "fusedmoe") -> dict[str, Path]:
    """Dotted module name -> file, for every .py of ``package`` under ``src`` (a package is its __init__.py)."""
    files = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(nodes):
    """The import statements among ``nodes`` and inside them, at any depth, except ``if TYPE_CHECKING:`` bodies."""
    for node in nodes:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        else:
            yield from _imports(ast.iter_child_nodes(node))


def _from_module(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name of the module that ``node``, a ``from ... import`` in ``module``, imports from."""
    if not node.level:
        return node.module
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def import_graph(files: dict[str, Path]) -> dict[str, list[Edge]]:
    """Module -> its edges (see the module docstring) to the other modules of ``files``."""
    graph = {}
    for module, path in files.items():
        targets = []
        for node in _imports(ast.parse(path.read_text(), filename=str(path)).body):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = _from_module(module, path, node)
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            targets += [(name, module, node.lineno) for name in names if name in files and name != module]
        graph[module] = sorted(set(targets))
    return graph


def find_cycles(graph: dict[str, list[Edge]]) -> list[list[Edge]]:
    """Cycles as lists of edges, one per edge that closes a cycle in a depth-first walk (once per sequence of
    modules: two imports of the same module give one); [] when there is none."""
    cycles, done, stack, path = {}, set(), [], []  # stack: the modules on the walk's path; path: its edges

    def visit(module: str) -> None:
        stack.append(module)
        for edge in graph.get(module, []):
            target = edge[0]
            if target in stack:
                cycles.setdefault((*stack[stack.index(target) :], target), [*path[stack.index(target) :], edge])
            elif target not in done:
                path.append(edge)
                visit(target)
                path.pop()
        stack.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return list(cycles.values())


def describe(cycle: list[Edge], files: dict[str, Path]) -> str:
    """``a -> b (a.py:12) -> a (b.py:3)``: each module, then the file and line of the import that reaches it."""
    steps = [cycle[0][1]]
    for target, source, line in cycle:
        steps.append(f"{target} ({files[source].relative_to(SRC)}:{line})")
    return " -> ".join(steps)


def test_the_package_has_no_import_cycle():
    files = module_files()
    cycles = find_cycles(import_graph(files))
    report = "\n  ".join(describe(cycle, files) for cycle in cycles)
    assert not cycles, f"import cycles between files of the package (module (file:line of its import)):\n  {report}"


def test_the_graph_holds_module_level_function_level_and_package_imports():
    targets = {module: {edge[0] for edge in edges} for module, edges in import_graph(module_files()).items()}
    assert len(targets) > 50
    assert "fusedmoe.api" in targets["fusedmoe.layer"]  # `from .api import ...` at module level
    assert "fusedmoe.distributed" in targets["fusedmoe.layer"]  # inside FusedMoE.__init__
    assert "fusedmoe.integrations.hf" in targets["fusedmoe.integrations.hf_quant"]  # `from . import hf`
    assert "fusedmoe.prepare_finalize.all_to_all" in targets["fusedmoe.prepare_finalize"]  # an __init__'s submodule
    assert "fusedmoe.workspace" in targets["fusedmoe"]  # `from .workspace import ...`: the package's __init__


def test_a_cycle_is_found_and_named(tmp_path):
    pkg = tmp_path / "demo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from . import b\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("import demo.b\n")
    files = module_files(tmp_path, "demo")
    (cycle,) = find_cycles(import_graph(files))  # b -> sub.c (in a function) -> b; a -> b is under TYPE_CHECKING
    assert cycle == [("demo.sub.c", "demo.b", 2), ("demo.b", "demo.sub.c", 1)]
    (pkg / "b.py").write_text("B = 1\n")
    assert find_cycles(import_graph(module_files(tmp_path, "demo"))) == []
