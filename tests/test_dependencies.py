"""pyproject.toml declares what the package imports: every third-party import of the shipped packages
is a declared dependency (module-level imports in ``dependencies``; imports made lazily inside a
function may come from an extra), and every runtime dependency is imported by the package (or is
listed in ``USED_INDIRECTLY`` with the reason). Imports are read with ``ast``, not by running code."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "models", "data_prep", "monitoring", "pipelines")
#: Runtime dependencies no ``import`` names, and why they are needed.
USED_INDIRECTLY = {
    "tensorboard": "torch.utils.tensorboard (monitoring/logger.py) needs it",
}
#: Import name -> distribution for packages that may not be installed here (optional trackers).
NOT_INSTALLED = {"wandb": "wandb", "mlflow": "mlflow"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {_norm(Requirement(r).name) for r in project["dependencies"]}
    extras = {name: {_norm(Requirement(r).name) for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    return runtime, extras


def _imports() -> dict[str, tuple[bool, str]]:
    """Top-level third-party module -> (imported at module level somewhere, one place that imports it)."""
    ours = set(PACKAGES)
    found: dict[str, tuple[bool, str]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            top_level = {id(n) for n in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in ours or top == "__future__":
                        continue
                    eager = id(node) in top_level
                    prior = found.get(top, (False, ""))
                    found[top] = (prior[0] or eager, prior[1] or f"{path.relative_to(REPO)}:{node.lineno}")
    return found


@functools.cache
def _module_to_dists() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distribution(module: str) -> str:
    dists = _module_to_dists().get(module) or [NOT_INSTALLED.get(module, module)]
    return _norm(dists[0])


def test_every_third_party_import_is_declared():
    runtime, extras = _declared()
    optional = set().union(*extras.values())
    problems = []
    for module, (eager, where) in sorted(_imports().items()):
        dist = _distribution(module)
        if dist in runtime:
            continue
        if eager:
            problems.append(f"{where} imports {module} at module level; add {dist} to [project] dependencies")
        elif dist not in optional:
            problems.append(f"{where} imports {module}; declare {dist} in dependencies or an extra")
    assert not problems, "\n".join(problems)


def test_every_runtime_dependency_is_imported():
    runtime, _ = _declared()
    imported = {_distribution(m) for m in _imports()}
    unused = sorted(runtime - imported - set(USED_INDIRECTLY))
    assert not unused, f"runtime dependencies the package never imports (move test-only ones to `dev`): {unused}"


def test_extras_users_ask_for_exist():
    _, extras = _declared()
    for extra, dist in {"wandb": "wandb", "mlflow": "mlflow", "near-dedup": "datasketch"}.items():
        assert dist in extras.get(extra, set()), f"pip install pretrain[{extra}] should install {dist}"
    assert "webdataset" in extras["dev"]  # the tests and benchmarks read shards with it; the package does not


def test_the_lowest_versions_job_tests_the_declared_torch_floor():
    """`make test-lowest` installs torch at pyproject's lower bound (not the newer local wheel), so the
    range a cluster's existing torch is kept for (README) is a tested one."""
    import subprocess

    torch_req = next(Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
                     if Requirement(r).name == "torch")
    floor = next(s.version for s in torch_req.specifier if s.operator == ">=")
    pins = subprocess.run([sys.executable, str(REPO / ".ci" / "lowest_pins.py"), str(REPO / "pyproject.toml")],
                          capture_output=True, text=True, check=True).stdout.split()
    assert f"torch=={floor}" in pins
    recipe = (REPO / "Makefile").read_text().split("\ntest-lowest:", 1)[1].split("\n\n", 1)[0]
    assert "TORCH_SPEC" not in recipe and "constraints.txt -e" in recipe  # torch comes from the pins, nothing else
