"""What each side of the house may import. The Controller's side (the state machine, the worker group, the
checkpoint catalogue, the worker actor's interface) imports no torch, and a run's Controller process never does,
the final model included: its process starts every run, and torch with what the workers import costs ~3 s of CPU
per process."""

from __future__ import annotations

import subprocess
import sys

import pytest
import ray
import torch

from raylastic.actors.status.run import RunStatus
from raylastic.cluster.job import train
from raylastic.jobconfig import STRATEGIES, StrategyConfig
from raylastic.jobconfig.naming import controller_name
from tests.conftest import REPO_ROOT
from tests.helpers import job, load_model
from tests.process_imports import training_imports

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


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_a_runs_controller_never_imports_torch_the_final_model_included(tmp_path, strategy):
    """The full model passes through the Controller as model.pt's bytes, read back in the driver."""
    seen: dict = {}

    def on_progress(progress: RunStatus) -> None:
        if progress.state == "finished":  # the Controller has returned the result, and still lives
            seen.update(ray.get(ray.get_actor(controller_name(f"imports-{strategy}")).__ray_call__.remote(
                training_imports), timeout=60))

    result = train(job(f"strategy.name={strategy}", "training.steps=3", name=f"imports-{strategy}"),
                   run_dir=tmp_path, on_progress=on_progress)
    assert seen == {"imported": False, "torch": False, "dynamo": False}
    written = load_model(tmp_path)
    assert set(result.model_state) == set(written) and written
    assert all(torch.equal(tensor, written[name]) for name, tensor in result.model_state.items())


@pytest.mark.parametrize("name", [name for name in STRATEGIES if name != "async_ps"])
def test_the_configs_replicated_flag_is_the_built_strategys(name):
    from raylastic.strategies.build import build_strategy

    config = StrategyConfig(name=name)
    assert config.replicated == build_strategy(config).replicated
