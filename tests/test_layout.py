"""Package layout: the core (everything outside ``fusedmoe.tools``, ``fusedmoe.integrations`` and ``__main__``)
imports none of the tools (cli, bench, tune, demo, presets), anywhere, and no integration at module level (only
``FusedMoE.from_hf_*``, convenience constructors, reach the transformers loader, lazily)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "fusedmoe"
OUTSIDE_CORE = ("fusedmoe.tools", "fusedmoe.integrations")


def _module(path: Path) -> list[str]:
    parts = ["fusedmoe", *path.relative_to(PACKAGE).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: Path, top_level_only: bool = False) -> list[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod[:-1]
    names = []
    tree = ast.parse(path.read_text())
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            names.append(target)
            names += [f"{target}.{a.name}" for a in node.names]
    return names


def _core_files() -> list[Path]:
    return [
        p
        for p in PACKAGE.rglob("*.py")
        if not ".".join(_module(p)).startswith(OUTSIDE_CORE) and p.name != "__main__.py"
    ]


def test_the_core_imports_no_tools():
    files = _core_files()
    assert any(p.name == "kernel.py" for p in files) and not any("tools" in p.parts for p in files)
    bad = {str(p.relative_to(PACKAGE)): n for p in files for n in _imports(p) if n.startswith("fusedmoe.tools")}
    assert not bad, f"core modules import tools: {bad}"


def test_the_core_imports_no_integration_at_module_level():
    bad = {
        str(p.relative_to(PACKAGE)): n
        for p in _core_files()
        for n in _imports(p, top_level_only=True)
        if n.startswith("fusedmoe.integrations")
    }
    assert not bad, f"core modules import integrations: {bad}"


def test_the_detector_sees_relative_imports():
    # a core-like file importing the tools relatively must be caught by the same resolution
    names = _imports(PACKAGE / "tools" / "bench" / "host.py")
    assert "fusedmoe.layer" in names and "fusedmoe.tools.presets" in names
