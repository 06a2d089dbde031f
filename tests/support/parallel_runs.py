"""Functions run on every rank by tests/test_tensor_parallel.py, tests/test_activation_checkpointing.py and
tests/test_gpt_pipeline.py (importable by the harness's processes): a few steps of the built-in GPT in a
model-parallel layout, as TrainWorker sets a generation up, and the trained state gathered whole."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.worker.evaluation import Evaluator
from raylastic.actors.worker.model_build import build_rank_model
from raylastic.actors.worker.optimizer_recipe import optimizer_factory
from raylastic.actors.worker.pipeline_step import Pipeline
from raylastic.actors.worker.step import StepRunner
from raylastic.jobconfig import OptimConfig, ParallelConfig, StrategyConfig
from raylastic.strategies.base import GroupContext, init_optimizer_state
from raylastic.strategies.build import build_strategy
from raylastic.strategies.checkpoint import Checkpointer, load_into
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.parallel_mesh import parallel_mesh
from raylastic.strategies.region_copy import keep_regions, restore_regions
from raylastic.strategies.region_plan import RegionCopy, plan_region_restore
from raylastic.workloads import load_workload
from raylastic.workloads.chargpt import GPT
from raylastic.workloads.gpt_parallel import parallelize_gpt
from raylastic.workloads.gpt_pipeline import split_gpt

WORKLOAD = ("chargpt", {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "corpus_chars": 60_000})
GLOBAL_BATCH = 8
OPTIM = OptimConfig(name="adamw", lr=1e-2, weight_decay=0.1, schedule="cosine", warmup_steps=1, min_lr=1e-3,
                    clip_grad_norm=0.5)
STEPS = 3
ADAM_TOLERANCE = 1e-4
"""Adam moves an element by ~lr whatever its gradient's size, so an element whose gradient is near zero moves by
float noise whose sign follows the summation order (tests/test_zero.py): 1e-4 is 1% of one step's lr (1e-2); a
wrong split would be off by whole updates."""


def setup(layout: ParallelLayout | None, strategy_name: str = "ddp", precision: str = "fp32",
          workload_spec: tuple[str, dict] = WORKLOAD, activation_checkpointing: str = "none",
          schedule: str = "1f1b", microbatches: int | None = None, scaler: torch.amp.GradScaler | None = None):
    """The strategy, state and step runner of one rank of a generation laid out as ``layout`` (None: no model
    parallelism; a pipeline by ``schedule`` in ``microbatches`` under pp), training ``workload_spec`` (name,
    options), as TrainWorker.join sets them up; ``scaler``: fp16's loss scaler."""
    workload = load_workload(*workload_spec)
    parallel = (ParallelConfig(tp=layout.tp, pp=layout.pp, **({"pp_schedule": schedule, "pp_microbatches": microbatches}
                                                               if layout.pp > 1 else {}))
                if layout is not None else ParallelConfig())
    strategy = build_strategy(StrategyConfig(name=strategy_name), parallel)
    mesh = parallel_mesh(torch.device("cpu"), layout) if layout is not None else None

    def build_model() -> torch.nn.Module:
        return build_rank_model(workload, torch.device("cpu"), mesh=mesh,
                                activation_checkpointing=activation_checkpointing)

    torch.manual_seed(0)
    build_optimizer = optimizer_factory(OPTIM, getattr(workload, "configure_optimizer", None))
    state = strategy.setup(build_model, build_optimizer, torch.device("cpu"), None,
                           GroupContext(node_ids=("node",) * dist.get_world_size(), completed_steps=0, mesh=mesh))
    dataset = workload.train_dataset()
    runner = StepRunner(workload=workload, dataset=dataset, strategy=strategy, optim=OPTIM, total_steps=STEPS,
                        order=GlobalSampleOrder(len(dataset), GLOBAL_BATCH, seed=0),
                        micro_batch_size=None if layout is not None and layout.pp > 1 else 2,
                        device=torch.device("cpu"), precision=precision, layout=layout, record_samples=True,
                        scaler=scaler,
                        pipeline=Pipeline.for_generation(state.model, mesh, parallel, device=torch.device("cpu"),
                                                         loss=getattr(workload, "pipeline_loss", None),
                                                         global_batch_size=GLOBAL_BATCH, seed=0,
                                                         scale=scaler.scale if scaler is not None else None))
    return workload, strategy, state, runner


def train_and_report(layout: ParallelLayout | None, strategy_name: str = "ddp", precision: str = "fp32",
                     checkpoint_root: str | None = None, workload_spec: tuple[str, dict] = WORKLOAD,
                     activation_checkpointing: str = "none") -> dict[str, Any]:
    """Train ``STEPS`` steps; on rank 0: the whole canonical state, each step's reported loss sums, samples and
    sample ids, and the evaluation's metrics. Saves a checkpoint under ``checkpoint_root`` if given."""
    workload, strategy, state, runner = setup(layout, strategy_name, precision, workload_spec,
                                              activation_checkpointing)
    results = [runner.run(state, step) for step in range(STEPS)]
    evaluator = Evaluator(workload, batch_size=4, device=torch.device("cpu"), autocast=runner.autocast)
    evaluator.layout = layout
    metrics = evaluator.run(state.model)
    if checkpoint_root is not None:
        save_checkpoint(checkpoint_root, strategy, state, strategy_name, layout)
    state_dict = whole_state(strategy, state)
    reported = [(r.loss_sum, r.samples, r.sample_ids) for r in results]
    all_reported = [None] * dist.get_world_size()
    dist.all_gather_object(all_reported, reported)
    return {"state": state_dict, "reported": all_reported, "metrics": metrics} if dist.get_rank() == 0 else {}


def save_checkpoint(root: str, strategy, state, strategy_name: str, layout: ParallelLayout | None) -> None:
    """Collective: the state's checkpoint of step ``STEPS`` under ``root``, written by every rank."""
    Checkpointer(root=root, every_steps=0, num_to_keep=1, config_hash="test", global_batch_size=GLOBAL_BATCH).save(
        STEPS, strategy.state_dict(state), strategy=strategy_name, world_size=dist.get_world_size(),
        layout=dataclasses.asdict(layout) if layout is not None else None).result()


def restore_and_report(layout: ParallelLayout | None, directory: str, strategy_name: str = "ddp",
                       workload_spec: tuple[str, dict] = WORKLOAD) -> dict[str, Any]:
    """Load the checkpoint in ``directory`` into a fresh state laid out as ``layout``; rank 0: the whole state."""
    _, strategy, state, _ = setup(layout, strategy_name, workload_spec=workload_spec)
    init_optimizer_state(state.optimizer)
    flat = strategy.state_dict(state)
    load_into(flat, directory)
    strategy.load_state_dict(state, flat)
    state_dict = whole_state(strategy, state)
    return state_dict if dist.get_rank() == 0 else {}


def assert_loads_exactly_at_tp2_and_dp4(path: str, saved: dict[str, torch.Tensor],
                                        workload_spec: tuple[str, dict] = WORKLOAD) -> None:
    """The checkpoint at ``path`` (of the whole state ``saved``) loads exactly at tp2 and at 4 data-parallel ranks,
    and ``raylastic export`` writes its model whole (run in the test's process; it starts the ranks)."""
    from raylastic.strategies.export import load_full_model_state
    from tests.support.distributed_harness import run_distributed

    at_tp2 = run_distributed(restore_and_report, 2, ParallelLayout(tp=2), path, "ddp", workload_spec, timeout_s=120)
    at_dp4 = run_distributed(restore_and_report, 4, None, path, "zero2", workload_spec, timeout_s=120)
    for loaded in (at_tp2[0], at_dp4[0]):
        assert loaded.keys() == saved.keys()
        for key in saved:
            assert torch.equal(loaded[key], saved[key]), key
    exported = load_full_model_state(path)  # what `raylastic export` writes
    assert exported.keys() == {key.removeprefix("model.") for key in saved if key.startswith("model.")}
    for key, tensor in exported.items():
        assert torch.equal(tensor, saved[f"model.{key}"]), key


def whole_state(strategy, state) -> dict[str, torch.Tensor]:
    """The canonical state with every DTensor gathered whole (collective)."""
    return {key: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for key, value in strategy.state_dict(state).items() if isinstance(value, torch.Tensor)}


def tensor_parallel_stages(num_stages: int) -> dict[str, float]:
    """A 3-block untied GPT cut into ``num_stages`` stages, each split over all ranks as a tp group and run one
    after the other (a pipeline's activations between stages are the ranks' sequence shards); against the whole
    model on one rank: the largest differences of the loss and of every parameter's gradient."""
    torch.manual_seed(0)
    whole = GPT(n_layer=3, n_head=2, n_embd=32, block_size=16, tie_embeddings=False)
    stages = [split_gpt(copy.deepcopy(whole), stage, num_stages) for stage in range(num_stages)]
    mesh = parallel_mesh(torch.device("cpu"), ParallelLayout(tp=dist.get_world_size()))
    for stage in stages:
        parallelize_gpt(stage, mesh.tp)
    generator = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, 256, (4, 16), generator=generator), torch.randint(0, 256, (4, 16),
                                                                                     generator=generator)
    expected = torch.nn.functional.cross_entropy(whole(idx).flatten(0, 1), targets.flatten())
    expected.backward()
    with loss_parallel():
        x = idx
        for stage in stages:
            x = stage(x)
        loss = torch.nn.functional.cross_entropy(x.flatten(0, 1), targets.flatten())
        loss.backward()
    gradients = {name: p.grad for stage in stages for name, p in stage.named_parameters()}
    return {"loss": abs(loss.full_tensor().item() - expected.item()),
            "gradients": max((g.full_tensor() - dict(whole.named_parameters())[n].grad).abs().max().item()
                             for n, g in gradients.items()),
            "names": sorted(gradients) == sorted(n for n, _ in whole.named_parameters())}


UNTIED = ("chargpt", {**WORKLOAD[1], "n_layer": 4, "tie_embeddings": False})
"""The built-in GPT with a head of its own (a pipeline puts the head and the embedding on different stages), and
a block for each of up to 4 stages."""


def pipeline_train_and_report(layout: ParallelLayout, strategy_name: str, schedule: str, microbatches: int,
                              precision: str = "fp32", checkpoint_root: str | None = None,
                              workload_spec: tuple[str, dict] = UNTIED) -> dict[str, Any]:
    """``STEPS`` steps of ``workload_spec`` through a pipeline of ``layout.pp`` stages (each split over its tp
    group, the strategy over dp), then its evaluation; on rank 0: the whole state (gathered over the stages), every
    step's reported loss sums, samples and sample ids, by rank, and the metrics. Saves a checkpoint under
    ``checkpoint_root`` if given."""
    workload, strategy, state, runner = setup(layout, strategy_name, precision, workload_spec, "none", schedule,
                                              microbatches)
    results = [runner.run(state, step) for step in range(STEPS)]
    evaluator = Evaluator(workload, batch_size=4, device=torch.device("cpu"), autocast=runner.autocast)
    evaluator.layout, evaluator.pipeline = layout, runner.pipeline
    metrics = evaluator.run(state.model)
    if checkpoint_root is not None:
        save_checkpoint(checkpoint_root, strategy, state, strategy_name, layout)
    stages = [None] * layout.pp
    dist.all_gather_object(stages, whole_state(strategy, state), group=runner.pipeline.group)
    reported = [None] * dist.get_world_size()
    dist.all_gather_object(reported, [(r.loss_sum, r.samples, r.sample_ids) for r in results])
    if dist.get_rank() != 0:
        return {}
    return {"state": {k: v for stage in stages for k, v in stage.items()}, "reported": reported, "metrics": metrics}


def relayout_and_report(old: ParallelLayout, old_strategy: str, new: ParallelLayout | None, new_strategy: str,
                        lost: tuple[int, ...]) -> dict[str, Any]:
    """Train ``STEPS`` steps of ``UNTIED`` at ``old`` (a pipeline by 1f1b where pp > 1), keep every rank's part
    (strategies/region_copy.py), forget the parts of the ranks in ``lost``, then set up ``new`` on the same
    ranks and restore it from the parts the others kept; on rank 0: the state trained, the state restored
    (both whole), the plan and every rank's traffic."""
    _, strategy, state, runner = setup(old, old_strategy, "fp32", UNTIED, "none", "1f1b",
                                       old.pp if old.pp > 1 else None)
    for step in range(STEPS):
        runner.run(state, step)
    group = runner.pipeline.group if runner.pipeline is not None else None
    trained = _whole_over_stages(strategy, state, group, old.pp)
    rank = dist.get_rank()
    kept = keep_regions(strategy, state, copy=RegionCopy(0, old, rank, STEPS))
    holdings = [None] * dist.get_world_size()
    dist.all_gather_object(holdings, [] if rank in lost else [kept.copy])
    plan = plan_region_restore(holdings)
    del state, runner
    _, strategy, state, runner = setup(new, new_strategy, "fp32", UNTIED, "none", "1f1b",
                                       new.pp if new is not None and new.pp > 1 else None)
    traffic = restore_regions([] if rank in lost else [kept], plan, strategy, state)
    group = runner.pipeline.group if runner.pipeline is not None else None
    restored = _whole_over_stages(strategy, state, group, new.pp if new is not None else 1)
    traffic_by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(traffic_by_rank, traffic)
    if rank != 0:
        return {}
    return {"trained": trained, "restored": restored, "plan": plan, "traffic": traffic_by_rank}


def relayout_each_and_report(cases: list[tuple]) -> list[dict[str, Any]]:
    """``relayout_and_report`` for each of ``cases`` (its arguments) in turn, on the same ranks."""
    return [relayout_and_report(*case) for case in cases]


def _whole_over_stages(strategy, state, pipeline_group, pp: int) -> dict[str, torch.Tensor]:
    """The whole canonical state: each stage's gathered whole, the stages' put together (collective)."""
    mine = whole_state(strategy, state)
    if pp == 1:
        return mine
    stages = [None] * pp
    dist.all_gather_object(stages, mine, group=pipeline_group)
    return {key: value for stage in stages for key, value in stage.items()}
