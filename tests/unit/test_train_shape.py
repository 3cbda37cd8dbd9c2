"""The shape of elasticctl/train/, held: the modules a script imports at the top, one folder per
part of the worker (its lifecycle, the groups, the recovery sources, the state transfer, sharding,
checkpoints, the watches), no module over 500 lines, no class over 300 lines or 15 fields, no two
modules of one name, and no import from a layer above (beside tests/unit/test_import_graph.py,
which holds that there is no cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

from test_import_graph import imports_of, module_names

TRAIN = Path(__file__).resolve().parents[2] / "elasticctl" / "train"
SCRIPT_FACING = {"__init__", "runtime", "state", "group", "phase", "sampler", "sample_ledger", "script", "porting",
                 "entry", "checkpoint"}
FOLDERS = {"worker", "groups", "recovery", "state_transfer", "sharding", "checkpoints", "watches"}
# Lowest first: a module imports from its own layer or one below, never above. The script-facing
# modules a worker part needs (State, Group, Phase, the replicated Checkpointer, the entry's notes)
# are a layer of their own; run() and the package's names are the top.
BASE = "base"
LAYERS = ["checkpoints", BASE, "state_transfer", "groups", "watches", "sharding", "recovery", "worker", "top"]
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_CLASS_FIELDS = 500, 300, 15


def layer_of(module: str) -> str:
    parts = module.split(".")[2:]  # after elasticctl.train
    if not parts or parts == ["runtime"]:
        return "top"
    return parts[0] if len(parts) > 1 or parts[0] in FOLDERS else BASE


def train_modules() -> dict[str, Path]:
    return {name: path for name, path in module_names().items() if name.startswith("elasticctl.train")}


def class_fields(node: ast.ClassDef) -> set[str]:
    """A class's fields: what its methods assign to ``self``, and its annotated class attributes
    (a dataclass's)."""
    fields = {statement.target.id for statement in node.body
              if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)}
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, ast.AnnAssign) else []
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                    fields.add(part.attr)
    return fields


def test_train_is_the_script_facing_modules_and_one_folder_per_part():
    top = {path.stem for path in TRAIN.glob("*.py")}
    folders = {path.name for path in TRAIN.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert (top, folders) == (SCRIPT_FACING, FOLDERS)
    assert all((TRAIN / folder / "__init__.py").read_text().startswith('"""') for folder in FOLDERS)


def test_no_module_is_too_long():
    long = {str(path.relative_to(TRAIN)): n for path in TRAIN.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_class_is_too_long_or_holds_too_many_fields():
    too_big = {}
    for path in TRAIN.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines, fields = node.end_lineno - node.lineno + 1, len(class_fields(node))
                if lines > MAX_CLASS_LINES or fields > MAX_CLASS_FIELDS:
                    too_big[f"{path.relative_to(TRAIN)}:{node.name}"] = (lines, fields)
    assert too_big == {}


def test_no_two_modules_share_a_name():
    stems = [path.stem for path in TRAIN.rglob("*.py") if path.stem != "__init__"]
    assert sorted({stem for stem in stems if stems.count(stem) > 1}) == []


def test_no_module_imports_from_a_layer_above_its_own():
    modules = module_names()
    upward = {}
    for name, path in train_modules().items():
        own = LAYERS.index(layer_of(name))
        above = sorted(other for other in imports_of(path, modules)
                       if other.startswith("elasticctl.train") and LAYERS.index(layer_of(other)) > own)
        if above:
            upward[name] = above
    assert upward == {}


def test_the_shape_checks_see_what_they_check():
    assert layer_of("elasticctl.train") == "top" and layer_of("elasticctl.train.runtime") == "top"
    assert layer_of("elasticctl.train.state") == BASE and layer_of("elasticctl.train.worker") == "worker"
    assert layer_of("elasticctl.train.groups.roster") == "groups"
    node = ast.parse("class C:\n    a: int\n    def f(self):\n        self.b, self.c = 1, 2\n").body[0]
    assert class_fields(node) == {"a", "b", "c"}
