"""What each side of the house may import. The Controller's side (the state machine, the worker group, the
checkpoint catalogue, the worker actor's interface) imports no torch: its process starts every run, and torch
with what the workers import costs ~3 s of CPU per process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jobconfig import STRATEGIES, StrategyConfig
from tests.conftest import REPO_ROOT

CONTROLLER_SIDE = ("actors.controller", "actors.worker_actor", "actors.rendezvous_keys",
                   "strategies.checkpoint_catalogue", "strategies.group_assignment")


@pytest.mark.parametrize("module", CONTROLLER_SIDE)
def test_the_controller_side_imports_no_torch(module):
    probe = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{module} imports {done.stdout.strip()}"


@pytest.mark.parametrize("name", [name for name in STRATEGIES if name != "async_ps"])
def test_the_configs_replicated_flag_is_the_built_strategys(name):
    from strategies.build import build_strategy

    config = StrategyConfig(name=name)
    assert config.replicated == build_strategy(config).replicated
