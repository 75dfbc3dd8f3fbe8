"""The folders are the architecture: each package may import only packages below it, and modules never import each
other in a cycle. Read from the source (every import, also the ones inside functions), so a lazy import cannot hide
an upward dependency. Imports under `if TYPE_CHECKING:` never run, so the layer check ignores them; the cycle check
counts them: two modules that need each other's names, even only for annotations, are one job split in two or two
jobs sharing a type that belongs in a third module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "evenrl"

# Lower number = lower layer. A module may import its own package and any lower layer, nothing at or above its layer
# in another package. The planner is torch-free (tests/test_plan.py checks that separately); rollout/ (torch) sits
# beside it, so neither imports the other.
LAYERS = {
    "errors": 0,
    "config": 1, "isolation": 1,
    "core": 2, "data": 2, "rewards": 2,
    "distributed": 3, "models": 3, "envs": 3,
    "engines": 4, "testing": 4,
    "agents": 5,
    "planner": 6, "rollout": 6,
    "train": 7,
    "report": 8, "demo": 9, "cli": 10, "__main__": 11, "__init__": 11,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, pkg: str | None = None, *, typing_too: bool = False) -> set[str]:
    """Every evenrl module `path` imports, at any depth of the file; those under `if TYPE_CHECKING:` only with
    `typing_too`. `pkg`: the package relative imports start from (default: the file's own)."""
    out: set[str] = set()
    if pkg is None:
        pkg = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = set() if typing_too else {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                                            for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "evenrl"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "evenrl":
                continue
            for a in node.names:  # `from evenrl.x import y` may name a submodule y
                sub = f"{base}.{a.name}"
                out.add(sub if _exists(sub) else base)
    return out


def _is_type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:`: imports for annotations only, never run."""
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (SRC / rel).with_suffix(".py").exists() or (SRC / rel / "__init__.py").exists()


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph(typing_too: bool = False) -> dict[str, set[str]]:
    return {_module_name(p): _imports(p, typing_too=typing_too) for p in SRC.rglob("*.py")}


def test_every_package_has_a_layer():
    assert {_package(m) for m in _graph()} <= set(LAYERS)


def test_no_package_imports_upwards():
    wrong = []
    for mod, deps in _graph().items():
        mine = _package(mod)
        for dep in deps:
            other = _package(dep)
            if other != mine and other != "__init__" and LAYERS[other] >= LAYERS[mine]:
                wrong.append(f"{mod} (layer {LAYERS[mine]}) imports {dep} (layer {LAYERS[other]})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = _graph(typing_too=True)
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d in graph and d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from evenrl.train import step\n    import evenrl.core.batch\n"
                 "from ..core.schedule import make_schedule\n"
                 "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from evenrl.train.loop import Run\n")
    assert _imports(f, pkg="evenrl.train") == {"evenrl.train.step", "evenrl.core.batch", "evenrl.core.schedule"}
    assert _imports(f, pkg="evenrl.train", typing_too=True) == {"evenrl.train.step", "evenrl.core.batch",
                                                                "evenrl.core.schedule", "evenrl.train.loop"}


def test_architecture_doc_names_every_module():
    """docs/architecture.md names every module under src/evenrl by its path there, with `.py`: `core/staleness.py`,
    `planner/peers/reader.py`, `cli.py` (`__init__.py` and `__main__.py` are exempt). A module added, moved or
    renamed without its line in the doc fails here."""
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(SRC).as_posix()
        if not re.search(rf"(?<![\w/.]){re.escape(rel)}(?!\w)", doc):
            missing.append(rel)
    assert not missing, "docs/architecture.md does not name: " + ", ".join(missing)


def test_no_module_over_450_lines():
    """One job per module: a module that grows past 450 lines is split by job (docs/CONTRIBUTING.md)."""
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"modules over 450 lines: {long}"


def test_what_is_applied_to_a_model_is_its_plan_not_attributes_on_it():
    """What parallelism, packing or precision did to a model is its ModelPlan (core.model_plan), kept beside it:
    no module sets an `evenrl_*` attribute on a model or module object (an attribute no import shows), by assignment
    or setattr."""
    set_on = re.compile(r"""\.evenrl_\w+\s*=(?!=)|setattr\([^,]+,\s*["']evenrl_""")
    found = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if set_on.search(line)]
    assert not found, f"evenrl_* attributes set on objects: {found}"


def test_the_update_leaves_the_reduction_to_its_strategy():
    """How gradients and statistics are summed (float or exact, replicated or FSDP2) is the model's reduction
    strategy, chosen once by train.parallelize (train/reduction.py): the update names neither setting, nor the
    exact sums' modules, which it once tested in 9 if-tests."""
    tree = ast.parse((SRC / "train" / "update.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    named = names & {"bitwise", "reproducibility", "sharded", "is_sharded", "exact", "exact_fsdp", "canonical_sum"}
    assert not named, f"train/update.py tests the reduction itself: {sorted(named)}"
    assert {"begin", "micro_batch", "backward_done", "add", "finish", "clip"} <= names  # the strategy's calls


# Who may read the config's parallel section (`<cfg>.parallel`): the config, the planner (the plan is made from it),
# the mesh (built from it once, then asked: sizes, groups, capacity weights and their mode), the parallelize step
# (a model's sharding and offload), and the launcher, whose liveness watch starts before any mesh exists.
READS_PARALLEL = {"distributed/mesh.py", "train/parallelize.py", "train/launch.py"}


def test_only_the_mesh_parallelize_and_planner_read_cfg_parallel():
    found = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                   if p.relative_to(SRC).parts[0] not in ("config", "planner")
                   and str(p.relative_to(SRC)) not in READS_PARALLEL
                   and any(isinstance(n, ast.Attribute) and n.attr == "parallel"
                           for n in ast.walk(ast.parse(p.read_text()))))
    assert not found, f"cfg.parallel read at run time (ask the mesh): {found}"
