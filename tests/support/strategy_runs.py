"""Functions run on every rank by tests/test_zero.py and tests/test_diloco.py (importable by spawned
processes)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from raylastic.actors.data.batch_split import BatchSplit
from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.worker.optimizer_recipe import optimizer_factory
from raylastic.actors.worker.step import StepRunner
from raylastic.jobconfig import OptimConfig, StrategyConfig
from raylastic.strategies.base import GroupContext, init_optimizer_state
from raylastic.strategies.build import build_strategy
from raylastic.strategies.checkpoint import Checkpointer, load_into
from raylastic.strategies.diloco import WIRE_DTYPES, OuterState
from raylastic.workloads import load_workload
from tests.support.distributed_harness import run_distributed
from tests.support.helpers import REORDERED_SUMS_ATOL, applied_samples, assert_states_close, load_model

WORKLOAD = ("chargpt", {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "corpus_chars": 60_000})
GLOBAL_BATCH = 12


OPTIMIZERS = {"adamw": OptimConfig(name="adamw", lr=1e-2), "sgd": OptimConfig(name="sgd", lr=0.2, momentum=0.9)}


def setup(strategy_name: str, optimizer: str = "adamw", replicas: int = 1, options: dict | None = None):
    """``options``: further StrategyConfig fields (compression, hierarchical: ranks 0 and 1 share a "node")."""
    workload = load_workload(*WORKLOAD)
    strategy = build_strategy(StrategyConfig(name=strategy_name, replicas=replicas, **(options or {})))
    torch.manual_seed(0)
    nodes = tuple("node-a" if rank < 2 else "node-b" for rank in range(dist.get_world_size()))
    state = strategy.setup(workload.build_model, optimizer_factory(OPTIMIZERS[optimizer]), torch.device("cpu"),
                           None, GroupContext(node_ids=nodes, completed_steps=0))
    dataset = workload.train_dataset()
    runner = StepRunner(workload=workload, dataset=dataset, strategy=strategy, optim=OPTIMIZERS[optimizer],
                        total_steps=10**6,
                        order=GlobalSampleOrder(len(dataset), GLOBAL_BATCH, seed=0), micro_batch_size=4,
                        device=torch.device("cpu"))
    return strategy, state, runner


def train_and_report(strategy_name: str, steps: int, checkpoint_root: str | None = None,
                     optimizer: str = "adamw", replicas: int = 1, shares: tuple[int, ...] | None = None,
                     options: dict | None = None) -> dict[str, Any]:
    """Train ``steps`` steps (the ranks taking ``shares`` of each batch; None: even shares); optionally
    checkpoint; return the full (gathered) canonical state."""
    strategy, state, runner = setup(strategy_name, optimizer, replicas, options)
    runner.split = BatchSplit(shares) if shares else None
    for step in range(steps):
        runner.run(state, step)
    if checkpoint_root is not None:
        checkpointer = Checkpointer(root=checkpoint_root, every_steps=0, num_to_keep=3, config_hash="test",
                                    global_batch_size=GLOBAL_BATCH)
        checkpointer.save(steps, strategy.state_dict(state), strategy=strategy_name,
                          world_size=dist.get_world_size()).result()
    return full_state(strategy, state)


def train_each_and_report(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``train_and_report(**run)`` for each of ``runs`` in turn, on the same ranks."""
    return [train_and_report(**run) for run in runs]


def train_and_count_bytes(strategy_name: str, steps: int, options: dict | None = None) -> dict[str, Any]:
    """Train ``steps`` steps (adamw, even shares); rank 0: the full state and every step's bytes sent and
    uncompressed bytes (this rank's, as StepResult reports them)."""
    strategy, state, runner = setup(strategy_name, "adamw", 1, options)
    results = [runner.run(state, step) for step in range(steps)]
    if dist.get_rank():
        return {}
    return {"state": full_state(strategy, state), "bytes_sent": [r.bytes_sent for r in results],
            "uncompressed_bytes": [r.uncompressed_bytes for r in results]}


def outer_step_after_many_samples(compression: str, samples: int, change: float) -> torch.Tensor:
    """One diloco outer step (lr 1, no momentum) from global parameters of zeros, rank r having moved them by
    ``-(r + 1) * change`` over ``(r + 1) * samples`` samples; returns the new global parameters."""
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    outer = OuterState(model, lr=1.0, momentum=0.0, wire_dtype=WIRE_DTYPES[compression])
    rank = dist.get_rank()
    with torch.no_grad():
        model.weight.fill_(-(rank + 1) * change)
    outer.samples = (rank + 1) * samples
    outer.step(model)
    return outer.params[0].detach().clone()


def restore_and_report(strategy_name: str, directory: str) -> dict[str, Any]:
    strategy, state, _ = setup(strategy_name)
    init_optimizer_state(state.optimizer)
    flat = strategy.state_dict(state)
    load_into(flat, directory)
    strategy.load_state_dict(state, flat)
    return full_state(strategy, state)


def full_state(strategy, state) -> dict[str, Any]:
    gathered = {}
    for key, value in strategy.state_dict(state).items():
        if isinstance(value, torch.Tensor):
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            gathered[key] = value.detach().clone()
    return gathered if dist.get_rank() == 0 else {}


def train_with_saves(strategy_name: str, steps: int, checkpoint_root: str, every: int) -> list[int]:
    """Train ``steps`` steps, saving every ``every`` steps; returns the steps saved."""
    strategy, state, runner = setup(strategy_name)
    checkpointer = Checkpointer(root=checkpoint_root, every_steps=every, num_to_keep=10, config_hash="test",
                                global_batch_size=GLOBAL_BATCH)
    saved = []
    for step in range(steps):
        runner.run(state, step)
        if checkpointer.due(step + 1):
            checkpointer.save(step + 1, strategy.state_dict(state), strategy=strategy_name,
                              world_size=dist.get_world_size()).result()
            saved.append(step + 1)
    return saved


def train_job_alone(job, workload_options: dict | None = None) -> dict[str, torch.Tensor]:
    """``job``'s model after ``training.steps`` steps on one rank (ddp, one micro-batch a step): the undisturbed
    run that an elastic run of the same job must end allclose to. ``workload_options`` replace the job's (a
    test's pause, which changes no math, left out)."""
    workload = load_workload(job.workload.name, workload_options if workload_options is not None
                             else job.workload.options)
    strategy = build_strategy(StrategyConfig(name="ddp"))
    torch.manual_seed(job.training.seed)
    state = strategy.setup(workload.build_model, optimizer_factory(job.optim), torch.device("cpu"), None,
                           GroupContext(node_ids=("node",), completed_steps=0))
    dataset = workload.train_dataset()
    runner = StepRunner(workload=workload, dataset=dataset, strategy=strategy, optim=job.optim,
                        total_steps=job.training.steps, seed=job.training.seed, micro_batch_size=None,
                        order=GlobalSampleOrder(len(dataset), job.training.global_batch_size, job.training.seed),
                        device=torch.device("cpu"))
    for step in range(job.training.steps):
        runner.run(state, step)
    return {name: tensor.detach().clone() for name, tensor in state.model.state_dict().items()}


def undisturbed_run(job, num_samples: int,
                    workload_options: dict | None = None) -> tuple[dict[int, list[int]], dict[str, torch.Tensor]]:
    """``job`` undisturbed, computed: each step's samples (its global batch, in the sample order of a dataset of
    ``num_samples``), by step from 1, and the parameters that training on them on one rank ends with
    (``train_job_alone``, in a process of its own; ``workload_options`` as there)."""
    order = GlobalSampleOrder(num_samples, job.training.global_batch_size, job.training.seed)
    samples = {step: order.rank_indices(step - 1, rank=0, world_size=1).tolist()
               for step in range(1, job.training.steps + 1)}
    return samples, run_distributed(train_job_alone, 1, job, workload_options, timeout_s=300)[0]


def undisturbed_run_of(job) -> tuple[dict[int, list[int]], dict[str, torch.Tensor]]:
    """``undisturbed_run`` of ``job`` on its workload's whole training set."""
    return undisturbed_run(job, len(load_workload(job.workload.name, job.workload.options).train_dataset()))


def undisturbed_alongside(job) -> Future:
    """``undisturbed_run_of(job)``, computed in a thread of its own: a test starts it before its Ray run, which
    spends most of its time waiting (on workers starting, on its pauses), and hands its result to
    ``assert_trained_as_undisturbed``."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="undisturbed")
    future = pool.submit(undisturbed_run_of, job)
    pool.shutdown(wait=False)
    return future


TINY_GPT_OPTIONS = ("workload.options={n_layer: 2, n_head: 2, n_embd: 32, block_size: 16, corpus_chars: 30000, "
                    "tie_embeddings: false}")
"""A chargpt small enough for a model-parallel Ray run on a 2-core machine (untied: every stage owns its layers)."""


SHIFT_INVARIANT_SUFFIX = ".attn.k.bias"
"""chargpt's attention key biases shift all of a query's scores by the same amount, which softmax ignores: their
gradient is 0 in exact arithmetic, so AdamW steps them by the float noise of a sum's order, up to ``lr`` a step
either way (two runs that sum in different orders part there by ~1e-5 over 50 steps, where every other parameter
agrees to ~1e-6)."""


def assert_trained_as_undisturbed(result, config, run_dir, steps: int,
                                  undisturbed: tuple[dict[int, list[int]], dict] | None = None) -> None:
    """Every step applied once to the samples an undisturbed run of ``config`` takes, ending with its parameters
    (the shift-invariant key biases: as small as noise makes them, on both). ``undisturbed``: that run's
    ``undisturbed_run_of(config)``, if computed already (while the run trained)."""
    num_samples = len(load_workload(config.workload.name, config.workload.options).train_dataset())
    samples, parameters = undisturbed if undisturbed is not None else undisturbed_run(config, num_samples)
    assert applied_samples(result.ledger, steps, num_samples) == samples
    got = load_model(run_dir)
    noise = {key for key in parameters if key.endswith(SHIFT_INVARIANT_SUFFIX)}
    for key in noise:
        assert max(got[key].abs().max(), parameters[key].abs().max()) <= config.optim.lr * steps, key
    assert_states_close({k: v for k, v in got.items() if k not in noise},
                        {k: v for k, v in parameters.items() if k not in noise}, rtol=1e-4, atol=REORDERED_SUMS_ATOL)
