"""No import cycle in elasticctl/: every module's imports of the package's own modules, read from
its source (module level, inside functions and under TYPE_CHECKING alike: a lazy or a typing-only
import is a dependency all the same), form a graph that the standard library's topological sorter
can order."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "elasticctl"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports (``from a import b`` names ``a.b`` when it is a
    module, else ``a``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    # A package's __init__ that only re-exports lazily (PEP 562) imports nothing at import time,
    # but importing a submodule runs its package's __init__ first: the edge is submodule -> package.
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def test_the_package_has_no_import_cycle():
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as exc:
        raise AssertionError(f"an import cycle in elasticctl/: {' -> '.join(exc.args[1])}") from None


def test_the_checker_sees_lazy_and_typing_only_imports(tmp_path):
    # The cycles this project once had ran through a function-level import and a TYPE_CHECKING one.
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg.a import thing\n")
    modules = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    graph = {name: imports_of(path, modules) for name, path in modules.items()}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError:
        return
    raise AssertionError("the cycle pkg.a <-> pkg.b was not found")


FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate")


def test_only_the_integrations_import_a_framework_and_nothing_imports_them():
    # The core install pulls no framework: elasticctl.integrations.<framework> alone imports one,
    # and no other module of the package imports an integration.
    modules = module_names()
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
        if not name.startswith("elasticctl.integrations"):
            assert not imported & set(FRAMEWORKS), f"{name} imports {sorted(imported & set(FRAMEWORKS))}"
    for name, imports in import_graph().items():
        if not name.startswith("elasticctl.integrations"):
            assert not {i for i in imports if i.startswith("elasticctl.integrations")}, f"{name} imports an integration"
