"""What each part of the house may import.

- The packages are layered: each imports only those before it in ``PACKAGE_LAYERS``.
- Each role folder of ``actors/`` imports only the roles its docstring's "May import (of actors/):" line names
  (a role, or one module of it as ``role.module``), and those lines name no circle of roles.
- No module imports itself back through others at import time (no import circles).
- The Controller's side (the state machine, the worker group, the checkpoint catalogue, the worker actor's
  interface) imports no torch, and a run's Controller process never does, the final model included: its process
  starts every run, and torch with what the workers import costs ~3 s of CPU per process."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Callable
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest
import ray
import torch

from raylastic.actors.status.run import RunStatus
from raylastic.cluster.job import train
from raylastic.jobconfig import STRATEGIES, StrategyConfig
from raylastic.jobconfig.naming import controller_name
from tests.conftest import REPO_ROOT
from tests.support.helpers import job, load_model
from tests.support.process_imports import training_imports

PACKAGE_LAYERS = ("jobconfig", "workloads", "strategies", "actors", "cluster", "tuning")
ACTORS = REPO_ROOT / "actors"
ROLE_RULE = re.compile(r"May import \(of actors/\): (.+?)\.\n")


def _module_files() -> dict[str, Path]:
    """Every module of the package, by its dotted name (``raylastic.actors.worker.step``)."""
    files = {}
    for package in PACKAGE_LAYERS:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            files[".".join(("raylastic", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return files


MODULES = _module_files()


def _imports(path: Path, *, at_import_time: bool) -> set[str]:
    """The raylastic modules ``path`` imports: anywhere in it, or only where its import runs them (not inside a
    function, not under ``if TYPE_CHECKING``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in MODULES)
        elif at_import_time and (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))):
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {name for name in found if name.startswith("raylastic.")}


def _role_rules() -> dict[str, set[str]]:
    rules = {}
    for init in sorted(ACTORS.glob("*/__init__.py")):
        rule = ROLE_RULE.search(init.read_text())
        assert rule, f"{init.relative_to(REPO_ROOT)}'s docstring says nothing of what it may import"
        allowed = [entry.strip() for entry in re.sub(r"\s*\([^)]*\)", "", rule.group(1)).split(",")]
        rules[init.parent.name] = set() if allowed == ["nothing"] else set(allowed)
    return rules


def test_each_package_imports_only_the_packages_below_it():
    for module, path in MODULES.items():
        own = module.split(".")[1]
        below = PACKAGE_LAYERS[:PACKAGE_LAYERS.index(own)]
        wrong = {name for name in _imports(path, at_import_time=False) if name.split(".")[1] not in (own, *below)}
        assert not wrong, f"{path.relative_to(REPO_ROOT)} imports {sorted(wrong)}; {own} may import {below}"


def test_each_actor_role_imports_only_what_its_docstring_allows():
    rules = _role_rules()
    assert {folder.name for folder in ACTORS.iterdir() if (folder / "__init__.py").exists()} == set(rules)
    assert not [path.name for path in ACTORS.glob("*.py") if path.name != "__init__.py"], "a module outside a role"
    for module, path in MODULES.items():
        parts = module.split(".")
        if parts[1] != "actors" or len(parts) < 3:
            continue
        role, allowed = parts[2], rules[parts[2]]
        for name in _imports(path, at_import_time=False):
            target = name.split(".")
            if target[1] != "actors" or len(target) < 3 or target[2] == role:
                continue
            assert target[2] in allowed or ".".join(target[2:4]) in allowed, (
                f"{path.relative_to(REPO_ROOT)} imports {name}; {role}/ may import {sorted(allowed) or 'nothing'}")


def test_the_roles_allowed_imports_form_no_circle():
    rules = {role: {entry.split(".")[0] for entry in allowed} for role, allowed in _role_rules().items()}
    try:
        order = list(TopologicalSorter(rules).static_order())
    except CycleError as circle:
        pytest.fail(f"the roles' rules name a circle: {circle.args[1]}")
    assert set(order) == set(rules)


def test_no_module_imports_itself_back_at_import_time():
    graph = {module: _imports(path, at_import_time=True) & set(MODULES) for module, path in MODULES.items()}
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as circle:
        pytest.fail(f"an import circle: {' -> '.join(circle.args[1])}")


def test_no_benchmark_script_imports_another():
    """A benchmark (``python -m benchmarks.<name>``: a module with a ``main`` and no leading underscore) takes what
    it shares from the library modules (benchmarks/common.py, benchmarks/sides.py, the peer's
    benchmarks/_torchrun_ddp.py, ...), not from another benchmark."""
    benchmarks = {path.stem: path for path in (REPO_ROOT / "benchmarks").glob("*.py")}
    scripts = {name for name, path in benchmarks.items()
               if not name.startswith("_") and re.search(r"^def main\(", path.read_text(), re.M)}
    for name in sorted(scripts):
        tree = ast.parse(benchmarks[name].read_text())
        imported = {node.module.split(".")[1] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.module and node.module.startswith("benchmarks.")}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                     and node.module == "benchmarks" for alias in node.names}
        assert not imported & scripts, f"benchmarks/{name}.py imports the scripts {sorted(imported & scripts)}"


CONTROLLER_SIDE = ("raylastic.actors.controller.controller", "raylastic.actors.worker.actor",
                   "raylastic.actors.rendezvous.keys", "raylastic.strategies.checkpoint_catalogue",
                   "raylastic.strategies.group_assignment")


@pytest.mark.processes
@pytest.mark.parametrize("module", CONTROLLER_SIDE)
def test_the_controller_side_imports_no_torch(module):
    probe = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{module} imports {done.stdout.strip()}"


def controller_imports_at_finish(run_name: str) -> tuple[Callable[[RunStatus], None], dict]:
    """An on_progress callback that asks run ``run_name``'s Controller what it imported once the run has finished
    (the Controller has returned the result, and still lives), and the dict its answer goes to."""
    seen: dict = {}

    def on_progress(progress: RunStatus) -> None:
        if progress.state == "finished":
            seen.update(ray.get(ray.get_actor(controller_name(run_name)).__ray_call__.remote(training_imports),
                                timeout=60))

    return on_progress, seen


@pytest.mark.usefixtures("ray_local")
def test_a_runs_controller_never_imports_torch_the_final_model_and_a_resume_included(tmp_path):
    """The full model (gathered from zero2's shards) passes through the Controller as model.pt's bytes, read back in
    the driver; a run that resumes picks its checkpoint by the files' sizes, DCP's metadata read by the ranks that
    load."""
    for steps, resumed_from in ((2, []), (3, [2])):
        on_progress, seen = controller_imports_at_finish("imports")
        result = train(job("strategy.name=zero2", f"training.steps={steps}", name="imports"), run_dir=tmp_path,
                       on_progress=on_progress)
        assert [e.step for e in result.events if e.type == "resumed"] == resumed_from
        assert result.final_step == steps and seen == {"imported": False, "torch": False, "dynamo": False}
        written = load_model(tmp_path)
        assert set(result.model_state) == set(written) and written
        assert all(torch.equal(tensor, written[name]) for name, tensor in result.model_state.items())


@pytest.mark.parametrize("name", [name for name in STRATEGIES if name != "async_ps"])
def test_the_configs_replicated_flag_is_the_built_strategys(name):
    from raylastic.strategies.build import build_strategy

    config = StrategyConfig(name=name)
    assert config.replicated == build_strategy(config).replicated
