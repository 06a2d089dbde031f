"""DiLoCo and local SGD (strategies/diloco.py): the math against synchronous DDP and its checkpoints in gloo
groups of local processes; a real run on a local Ray that loses a worker between two outer steps."""

from __future__ import annotations

import pytest
import torch

from cluster.job import train
from jobconfig import load_job_config
from tests.distributed_harness import run_distributed as run_on_ranks
from tests.helpers import job
from tests.strategy_runs import restore_and_report, train_and_report
from tuning.search_space import SearchSpace

LOCAL_SGD_EVERY_STEP = {"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0}


def test_local_sgd_syncing_every_step_is_ddp():
    """Inner SGD with momentum is linear in the gradients, so averaging the ranks' updates every step is
    averaging their gradients: the same parameters as DDP on the whole batch (each rank's momentum buffer is
    its own; their mean is DDP's)."""
    reference = run_on_ranks(train_and_report, 1, "ddp", 4, None, "sgd")[0]
    state = run_on_ranks(train_and_report, 3, "diloco", 4, None, "sgd", 1, None, LOCAL_SGD_EVERY_STEP)[0]
    parameters = [key for key in reference if key.startswith("model.")]
    assert parameters
    for key in parameters:
        torch.testing.assert_close(state[key], reference[key], rtol=1e-5, atol=1e-6, msg=key)


def test_outer_steps_differ_from_ddp_when_workers_train_apart():
    reference = run_on_ranks(train_and_report, 1, "ddp", 4, None, "adamw")[0]
    state = run_on_ranks(train_and_report, 3, "diloco", 4, None, "adamw", 1, None,
                         {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9})[0]
    assert any(not torch.allclose(state[key], reference[key]) for key in reference if key.startswith("model."))
    assert any(key.startswith("outer.") for key in state)  # the outer momentum is part of the state


def test_a_checkpoint_after_an_outer_step_resumes_at_another_world_size(tmp_path):
    options = {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9}
    saved = run_on_ranks(train_and_report, 3, "diloco", 4, str(tmp_path), "adamw", 1, None, options)[0]
    directory = next(tmp_path.glob("step_*"))
    restored = run_on_ranks(restore_and_report, 2, "diloco", str(directory))[0]
    assert saved.keys() == restored.keys()
    shared = [key for key in saved if key.startswith(("model.", "outer."))]  # the inner state is each worker's own
    assert any(key.startswith("outer.") for key in shared)
    for key in shared:
        torch.testing.assert_close(restored[key], saved[key], msg=key)


def test_checkpoints_must_fall_on_outer_steps():
    with pytest.raises(ValueError, match=r"checkpoint.every_steps \(15\) must be a multiple of strategy.sync_every"):
        load_job_config(None, ["strategy.name=diloco", "strategy.sync_every=10", "checkpoint.every_steps=15"])
    ddp, diloco = (load_job_config(None, [f"strategy.name={name}"]) for name in ("ddp", "diloco"))
    assert ddp.math_hash() != diloco.math_hash()  # one's checkpoints never resume the other


def test_sync_every_is_a_sweepable_key():
    base = load_job_config(None, ["strategy.name=diloco"])
    space = SearchSpace.from_dict({"strategy.sync_every": {"choice": [10, 50]}})
    space.validate(base)
    assert space.apply(base, {"strategy.sync_every": 10}).strategy.sync_every == 10


@pytest.mark.usefixtures("ray_local")
def test_a_worker_lost_between_outer_steps_costs_only_its_own_inner_steps(tmp_path):
    steps, every = 100, 10
    base = ["strategy.name=diloco", f"strategy.sync_every={every}", f"training.steps={steps}",
            "scaling.min_workers=2", "scaling.max_workers=3", "optim.lr=3e-3"]
    calm = train(job(*base, name="diloco-calm"), run_dir=tmp_path / "calm")
    killed = train(job(*base, "faults=[{action: kill, rank: 1, step: 25}]", name="diloco-kill"),
                   run_dir=tmp_path / "kill")
    for result in (calm, killed):
        assert result.final_step == steps and result.metrics["accuracy"] > 0.85, result.metrics
    synced = [row["step"] for row in calm.history if row["bytes_sent"]]
    assert synced == list(range(every, steps + 1, every))  # one all-reduce per outer step, none between
    formed = [e for e in killed.events if e.type == "generation_formed"]
    assert len(formed) >= 2 and all(e.details["steps_lost"] == 0 for e in formed)
    assert all(isinstance(e.details["state_source"], int) for e in formed[1:])  # from a survivor, not a restart
    rows = {row["step"]: row for row in killed.history}
    assert rows[26]["loss"] < 0.5 * rows[1]["loss"]  # the survivors' training went on
