"""The import graph of the project's packages: no cycles, and no import upward across the layers.

The layers (lowest first) are documented in README's "Map of the code" and in each package's
``__init__`` docstring. The graph is read from the source with ``ast`` (every ``import`` and
``from … import``, including the ones inside functions), so a lazy import cannot hide a
dependency that the layering forbids.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "models", "data_prep", "monitoring", "pipelines")

#: unit -> the units it may import (besides itself). A unit is a top-level package, or a
#: sub-package / top-level module of `pipelines`.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "models": {"core"},
    "data_prep": {"core"},
    "monitoring": {"core", "models"},
    "pipelines.loading": {"core"},
    "pipelines.engine": {"core", "models", "monitoring", "pipelines.loading"},
    "pipelines.finetune": {"core", "models", "monitoring", "pipelines.loading", "pipelines.engine"},
    "pipelines.study": {"core", "models", "monitoring", "pipelines.loading", "pipelines.engine"},
    "pipelines.ops": {
        "core", "models", "monitoring", "data_prep", "pipelines.loading", "pipelines.engine",
        "pipelines.finetune", "pipelines.study",
    },
}
ENTRY_POINTS = {"pipelines", "pipelines.cli", "pipelines.pretrain"}  # may import everything


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    if parts[0] == "pipelines" and len(parts) > 1:
        return f"pipelines.{parts[1]}"
    return parts[0]


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return {name for name in found if _unit(name) is not None}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for imported in _imports(path, name):
            # `from pkg import name` lists both pkg and pkg.name: keep the longest that is a module
            if imported in modules and imported != name:
                deps.add(imported)
            elif imported.rsplit(".", 1)[0] in modules and imported.rsplit(".", 1)[0] != name:
                deps.add(imported.rsplit(".", 1)[0])
        graph[name] = deps
    return graph


GRAPH = _graph()


def test_every_unit_is_known():
    units = {_unit(m) for m in GRAPH} - ENTRY_POINTS
    unknown = units - set(ALLOWED)
    assert not unknown, f"new package(s) {unknown}: add them to ALLOWED and to README's map of the code"
    assert "pipelines.engine.trainer" in GRAPH and "core.corpus" in GRAPH  # the walk found the code


def test_pipelines_top_level_holds_only_entry_points_and_subpackages():
    top = {p.name for p in (REPO / "pipelines").glob("*.py")}
    assert top == {"__init__.py", "cli.py", "pretrain.py"}


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m not in ENTRY_POINTS))
def test_no_upward_import(module):
    unit = _unit(module)
    bad = sorted(d for d in GRAPH[module] if _unit(d) != unit and _unit(d) not in ALLOWED[unit])
    assert not bad, f"{module} ({unit}) imports {bad}; {unit} may import only {sorted(ALLOWED[unit])}"


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 = on the DFS stack, 2 = done
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(GRAPH.get(node, ())):
            # a package __init__ importing its own submodules is how packages re-export, not a cycle
            if node == dep.rsplit(".", 1)[0] or dep == node.rsplit(".", 1)[0]:
                continue
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


#: Third-party packages only some units may import (a lazy import counts): only the engine knows DeepSpeed.
RESTRICTED = {"deepspeed": ("pipelines.engine",)}


def _third_party(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    return {name.split(".")[0] for name in names}


@pytest.mark.parametrize("package", sorted(RESTRICTED))
def test_restricted_packages_are_imported_only_where_allowed(package):
    allowed = RESTRICTED[package]
    offenders = sorted(
        _module_name(p) for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")
        if package in _third_party(p) and not any(_module_name(p).startswith(f"{unit}.") for unit in allowed)
    )
    assert not offenders, f"{offenders} import {package}; only {allowed} may (ask the Engine instead)"


def test_checker_sees_a_planted_violation(tmp_path):
    """The walk reads lazy imports inside functions and relative imports (so the tests above can fail)."""
    pkg = tmp_path / "monitoring"
    pkg.mkdir()
    (pkg / "x.py").write_text("def f():\n    from pipelines.engine import trainer\n    from . import y\n")
    deps = _imports(pkg / "x.py", "monitoring.x")
    assert "pipelines.engine.trainer" in deps and "monitoring.y" in deps
    (pkg / "z.py").write_text("def f():\n    from deepspeed.utils import safe_get_full_grad\n")
    assert "deepspeed" in _third_party(pkg / "z.py")
