"""zero3 after a worker is SIGKILLed from outside: the survivors re-form at once, and
the run ends with its checkpoint and model.pt, also once the replacement has brought the group back to
the size it started at.

Two causes, each with a test here that needs no Ray (strategies/fsdp.py has the fixes):
- DTensor caches the output specs of its ops by DeviceMesh, and DeviceMesh equality leaves out this
  process's place in the mesh. A survivor whose rank changed, in a group of a size it had been in
  before, got the earlier group's mesh back on the thread that had used it (Ray runs an actor's calls on
  long-lived threads), so its shards were saved at another rank's offsets: DCP's plan of the final save
  failed ("Failed to validate global plan ... invalid fill").
- Those caches kept the old mesh alive, and through it the old gloo group: its connections stayed open
  after the survivors left it, so a survivor blocked in one of its collectives (one not next to the lost
  rank in gloo's ring) waited out failure.collective_timeout_s: ~30 s to form the next generation.

Run: ``pytest tests/test_zero3_recovery.py`` (about 1.5 minutes on 2 cores).
"""

from __future__ import annotations

import gc
import os
import signal
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from raylastic.actors.status.run import RunStatus
from raylastic.cluster.job import train
from raylastic.strategies.base import TrainState, init_optimizer_state
from raylastic.strategies.fsdp import FSDPStrategy
from raylastic.strategies.process_group import leave_group
from raylastic.workloads.digits import Digits
from tests.support.distributed_harness import run_distributed
from tests.support.helpers import REORDERED_SUMS_ATOL, assert_states_close, job, load_model
from tests.support.strategy_runs import undisturbed_run

COLLECTIVE_TIMEOUT_S = 120.0
"""Long: the run checks that the survivors did not wait it out (asserting well under it)."""
STEPS = 300
KILLED_RANK = 1
"""Killed in generation 0 (4 ranks): ranks 2 and 3 survive with new ranks, 1 and 2, in generations 1 and 2."""
KILL_AT_STEP = 30
PEERS_STAY_S = 60.0
"""How long peers that left a group stay alive while one that did not is blocked in its collective."""
GROUP_TIMEOUT_S = 3 * PEERS_STAY_S
"""The blocked peer's group's timeout: it must not be what ends its collective either."""


def _build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every rank starts from the same full parameters
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _set_up() -> TrainState:
    return FSDPStrategy(reshard_after_forward=True).setup(
        _build_model, lambda model: torch.optim.Adam(model.parameters(), lr=1e-2), torch.device("cpu"), None)


def _train_one_step(state: TrainState) -> None:
    generator = torch.Generator().manual_seed(dist.get_rank())
    inputs, targets = torch.randn(8, 64, generator=generator), torch.randint(0, 10, (8,), generator=generator)
    state.optimizer.zero_grad()
    torch.nn.functional.cross_entropy(state.wrapped(inputs), targets).backward()
    state.optimizer.step()


def _full(flat: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in flat.items()}


def _save_and_load(checkpoint_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """Set up, save a checkpoint of the state (model and Adam's), read it back whole, and load it back
    into the live state once that is zeroed; each as full tensors."""
    strategy, state = FSDPStrategy(reshard_after_forward=True), _set_up()
    init_optimizer_state(state.optimizer)
    flat = strategy.state_dict(state)
    live = _full(flat)
    dcp.save(flat, checkpoint_id=checkpoint_dir)
    whole = {k: torch.empty_like(v) for k, v in live.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(whole, checkpoint_id=checkpoint_dir, no_dist=True)
    with torch.no_grad():
        for tensor in flat.values():
            tensor.zero_()
    loading = strategy.state_dict(state)
    dcp.load(loading, checkpoint_id=checkpoint_dir)
    strategy.load_state_dict(state, loading)
    return {"live": live, "checkpoint": whole, "loaded": _full(strategy.state_dict(state))}


def _same_size_group_again(store_dir: str, checkpoint_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """zero3 set up in a group, then in a new group of the same size where this rank has the other place,
    both on one long-lived thread, as a Ray actor runs its ``join`` calls; the second group saves and loads."""
    with ThreadPoolExecutor(max_workers=1) as calls:
        calls.submit(lambda: _train_one_step(_set_up())).result()
        gc.collect()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        leave_group()
        dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/second", world_size),
                                rank=world_size - 1 - rank, world_size=world_size, timeout=timedelta(seconds=30))
        return calls.submit(_save_and_load, checkpoint_dir).result()


def test_a_same_size_group_with_ranks_swapped_saves_and_loads_its_shards(tmp_path):
    results = run_distributed(_same_size_group_again, 2, str(tmp_path), str(tmp_path / "checkpoint"), timeout_s=90)
    for result in results:
        assert_states_close(result["checkpoint"], result["live"], rtol=0, atol=0)  # each shard at its own offsets
        assert_states_close(result["loaded"], result["live"], rtol=0, atol=0)


BLOCKED_RANK = 2


def _peer_blocked_in_a_left_group(done_flag: str) -> float | None:
    """Every rank trains a zero3 step; then ranks 0 and 1 leave the group as TrainWorker.join does (state
    dropped, garbage collected, group left) and stay alive, while rank 2 blocks in a collective of the old
    group. Returns, on rank 2, how long that collective took to fail."""
    state = _set_up()
    _train_one_step(state)
    if dist.get_rank() == BLOCKED_RANK:
        started = time.monotonic()
        try:
            dist.all_gather([torch.empty(4) for _ in range(dist.get_world_size())], torch.zeros(4))
        except RuntimeError:
            return time.monotonic() - started
        finally:
            Path(done_flag).touch()
        raise AssertionError("the all_gather completed without the ranks that had left")
    del state
    gc.collect()
    leave_group()
    deadline = time.monotonic() + PEERS_STAY_S
    while not Path(done_flag).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return None


def test_leaving_a_zero3_group_releases_a_peer_blocked_in_it(tmp_path):
    results = run_distributed(_peer_blocked_in_a_left_group, 3, str(tmp_path / "done"), timeout_s=GROUP_TIMEOUT_S)
    blocked_for_s = results[BLOCKED_RANK]
    assert blocked_for_s < PEERS_STAY_S / 3  # not until the peers' processes end (or the group's timeout)


def _kill_rank_once(step: int, rank: int) -> tuple[Any, dict[str, Any]]:
    """An on_progress callback that SIGKILLs the worker of ``rank`` from outside once generation 0 has
    committed ``step`` steps; returns it and what it did."""
    done: dict[str, Any] = {}

    def on_progress(progress: RunStatus) -> None:
        if done or progress.generation != 0 or progress.step < step:
            return
        name = progress.members[rank]
        done.update(worker=name, step=progress.step, pid=ray.get(ray.get_actor(name).pid.remote()))
        os.kill(done["pid"], signal.SIGKILL)

    return on_progress, done


@pytest.mark.usefixtures("ray_local")
def test_zero3_run_survives_an_outside_sigkill_and_its_replacement(tmp_path):
    on_progress, killed = _kill_rank_once(KILL_AT_STEP, KILLED_RANK)
    config = job("strategy.name=zero3", "scaling.min_workers=2", "scaling.max_workers=4", "checkpoint.every_steps=0",
                 f"training.steps={STEPS}", f"failure.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
                 "workload.name=tests.support.user_workload:SlowDigits", "workload.options={pause_s: 0.01}",
                 name="zero3kill")
    result = train(config, run_dir=tmp_path / "run", on_progress=on_progress)
    events = result.events
    where = f"killed {killed.get('worker')} at step {killed.get('step')}: {events}"
    assert killed and result.final_step == STEPS, where
    failed_at = next(i for i, e in enumerate(events) if e.type == "worker_failed")
    formed = [e for e in events[failed_at:] if e.type == "generation_formed"]
    assert formed[0].details["world_size"] == 3, where  # the lost shards from the buddy copy (the default)
    assert formed[0].details["state_source"] == "buddy" and formed[0].details["steps_lost"] <= 1, where
    assert formed[0].details["duration_s"] < COLLECTIVE_TIMEOUT_S / 3, where  # survivors did not wait it out
    assert formed[-1].details["world_size"] == 4, f"the replacement never joined: {where}"
    assert any(e.type == "checkpointed" and e.step == STEPS for e in events), where
    _, parameters = undisturbed_run(config, len(Digits().train_dataset()))
    assert_states_close(load_model(tmp_path / "run"), parameters, atol=REORDERED_SUMS_ATOL)  # join anywhere
