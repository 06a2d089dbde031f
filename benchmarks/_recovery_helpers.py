"""The parts of benchmarks/recovery.py that run inside Ray workers - Ray Train's train loop, a start-up
probe, our Controller with the recovery fix it suggests - and its plot. Imported as
``benchmarks._recovery_helpers`` so Ray workers (PYTHONPATH = the repository root) import it by name;
heavy imports stay inside functions.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from raylastic.actors.processes import setup_hook

HIDDEN = 512
"""The width of the recovery benchmarks' digits MLP (benchmarks/recovery.py, benchmarks/redundancy.py)."""
TIMELINE_STEPS_BEFORE_KILL = 25
"""The failure timelines keep steps from K-25 on: what the plot shows."""


def summarize_failure(commits: list[tuple[int, float]], kill_step: int) -> dict[str, Any]:
    """``commits``: (step, time) of every step commit in commit order, redone steps included."""
    kill_at = next(t for s, t in commits if s == kill_step - 1)
    after = [(s, t) for s, t in commits if t > kill_at]
    first_step, first_at = after[0]
    lost = (kill_step - 1) - (first_step - 1)
    return {"recovery_s": round(first_at - kill_at, 4), "first_step_after_kill": first_step,
            "back_at_step_k_s": round(next(t for s, t in after if s == kill_step) - kill_at, 4),
            "committed_steps_lost": lost, "steps_redone": lost + 1,
            "timeline": [[round(t - kill_at, 4), s] for s, t in commits if s >= kill_step - TIMELINE_STEPS_BEFORE_KILL]}


RECOVERY_BREAKDOWN = ("detected_s", "to_forming_s", "forming_s", "first_step_s")


def recovery_breakdown(commits: list[tuple[int, float]], kill_step: int, started: float, failed: Any,
                       formed: Any) -> dict[str, float]:
    """Where the time from the kill to the next step went: until the Controller heard of the loss
    (``detected_s``), until the survivors' new generation started forming (``to_forming_s``), forming it with the
    state restored (``forming_s``), and its first step (``first_step_s``). ``failed``, ``formed``: the run's
    ``worker_failed`` event and the ``generation_formed`` after it; ``commits`` and ``started`` + their ``time_s``
    on the same clock."""
    kill_at = next(t for s, t in commits if s == kill_step - 1)
    failed_at, formed_at = started + failed.time_s, started + formed.time_s
    first_at = next(t for _, t in commits if t > formed_at)
    forming = formed.details["duration_s"]
    return {"detected_s": round(failed_at - kill_at, 4), "to_forming_s": round(formed_at - forming - failed_at, 4),
            "forming_s": forming, "first_step_s": round(first_at - formed_at, 4)}


RAY_TRAIN_FACTS = {  # paths under the installed ray package (2.60), for what the JSON reports about Ray Train
    "elastic_resize_monitor_interval_s": "ray/train/v2/api/config.py:102 ScalingConfig.elastic_resize_monitor_"
                                         "interval_s = 60.0: ElasticScalingPolicy (v2/_internal/execution/"
                                         "scaling_policy/elastic.py:204-221) considers no resize before it passed",
    "resize_restarts_the_group": "v2/_internal/execution/controller/controller.py:311 '# Standard: full restart.': "
                                 "a ResizeDecision shuts the worker group down and starts a new one",
    "health_check_interval_s": "v2/_internal/constants.py:37 DEFAULT_HEALTH_CHECK_INTERVAL_S = 2.0: the controller "
                               "polls workers; failures and reported checkpoints are seen at a poll",
    "report_queue": "v2/_internal/execution/worker_group/worker.py:294 result_queue=Queue(maxsize=1): report() blocks "
                    "until a poll took the previous result, so a checkpoint is registered only at the next poll",
}


def fit_ray_train(scratch: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Run ``ray_train_loop`` with TorchTrainer; returns its start time, rank 0's log records, the kill time."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    log, marker = scratch / "ray_train_log.jsonl", scratch / "ray_train_killed"
    trainer = TorchTrainer(ray_train_loop, train_loop_config={**config, "log": str(log), "marker": str(marker)},
                           scaling_config=ScalingConfig(num_workers=config["num_workers"], use_gpu=False),
                           run_config=RunConfig(name="recovery", storage_path=str(scratch / "storage"),
                                                failure_config=FailureConfig(max_failures=config["max_failures"])))
    started = time.time()
    trainer.fit()
    return {"started": started, "records": [json.loads(line) for line in log.read_text().splitlines()],
            "killed_at": float(marker.read_text())}


def ray_train_loop(config: dict[str, Any]) -> None:
    """The Ray Train side of the job: our digits MLP, global batch, AdamW and sample order, on DDP.

    Rank 0 appends ``{"step", "time"}`` to ``config["log"]`` as each step commits (and
    ``{"resumed_from", "time"}`` when a worker group starts); rank 1 SIGKILLs itself once, just before
    step ``config["kill_step"]``, after writing the time to ``config["marker"]``. Rank 0 reports a
    checkpoint every ``config["checkpoint_every"]`` steps; a restarted group resumes from the newest.
    """
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    from raylastic.actors.data.order import GlobalSampleOrder
    from raylastic.workloads.digits import Digits

    torch.set_num_threads(1)  # as our workers with cpus_per_worker=1
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(config["seed"])
    workload = Digits(hidden=config["hidden"])
    data = workload.train_dataset()
    model = workload.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as directory:
            state = torch.load(Path(directory) / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    model = ray.train.torch.prepare_model(model)
    log, marker, batch = Path(config["log"]), Path(config["marker"]), config["global_batch_size"]
    if rank == 0:
        _append(log, {"resumed_from": start, "time": time.time()})
    order = GlobalSampleOrder(len(data), batch, config["seed"])
    for step in range(start, config["steps"]):
        if rank == 1 and step + 1 == config["kill_step"] and not marker.exists():
            marker.write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        indices = order.rank_indices(step, rank, world_size)
        inputs, targets = data.tensors[0][indices], data.tensors[1][indices]
        optimizer.zero_grad(set_to_none=True)
        loss = workload.training_step(model, (inputs, targets)) * len(indices)  # summed over the samples
        (loss * world_size / batch).backward()
        metrics = torch.stack([loss.detach().double(), torch.tensor(float(len(indices)), dtype=torch.float64)])
        dist.all_reduce(metrics)  # as ours: the step's loss and sample count
        optimizer.step()
        if rank == 0:
            _append(log, {"step": step + 1, "time": time.time()})
        if (step + 1) % config["checkpoint_every"] == 0:
            with tempfile.TemporaryDirectory() as directory:
                saved = None
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "step": step + 1}, Path(directory) / "state.pt")
                    saved = ray.train.Checkpoint.from_directory(directory)
                ray.train.report({"step": step + 1}, checkpoint=saved)


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")


class Blocker:
    """Holds a CPU until it is killed, so that resources "appear" when it goes."""

    def ready(self) -> bool:
        return True


class StartupProbe:
    """What a new TrainWorker pays before it can train, phase by phase: time.time() marks taken in order.

    Its process is one Ray started for the job, so the job's setup hook (actors/processes/setup_hook.py) imported torch
    and the worker's modules in it first: just before the probe was asked for (a cold start), or earlier (a
    warm process). It then runs TrainWorker's constructor (workload and data, strategy) and its first join, into
    a group of its own (world size 1): a gc collection, the rendezvous, the model and the optimizer (a DDP too
    at world size 2). ``job_overrides`` are the job's ``--set`` overrides.
    """

    def __init__(self, job_overrides: list[str], store: object) -> None:
        """``store``: a ready RendezvousKeys actor, made before the probe is asked for, as the Controller's is."""
        marks = {"constructor": time.time()}
        from raylastic.actors.worker.actor import WorkerSpec
        from raylastic.actors.worker.train_worker import TrainWorker
        from raylastic.jobconfig import load_job_config
        from raylastic.strategies.checkpoint import Checkpointer
        from raylastic.strategies.group_assignment import GroupAssignment, new_store_prefix

        job = load_job_config(None, job_overrides)
        checkpointer = Checkpointer(root=tempfile.mkdtemp(prefix="startup-probe-"), every_steps=0, num_to_keep=1,
                                    config_hash=job.math_hash(), global_batch_size=job.training.global_batch_size)
        worker = TrainWorker(WorkerSpec.for_job(job, checkpointer))
        marks["construct_worker"] = time.time()
        worker.join(GroupAssignment(generation=0, rank=0, world_size=1, store=store, store_prefix=new_store_prefix(),
                                    timeout_s=30))
        marks["first_join"] = time.time()
        self.marks, self.imported = marks, setup_hook.imported
        self._alive = (worker, store)  # the group's store lives as long as the probe

    def timings(self) -> tuple[dict[str, float], setup_hook.ImportTimes | None]:
        return self.marks, self.imported


def plot(rounds: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def median_round(key: str, field: str) -> dict | None:
        done = sorted((r for r in rounds if field in r.get(key, {})), key=lambda r: r[key][field])
        return done[len(done) // 2][key] if done else None

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(19, 4.8))
    for key, label, color in [("ours_min1", "ours, min_workers=1", "tab:blue"),
                              ("ours_min2", "ours, min=max=2 (waits for a replacement)", "tab:green"),
                              ("ours_min2_late", "ours, min=max=2, replacement in a warm process", "tab:olive"),
                              ("ours_spare", "ours, min=max=2 + 1 warm spare", "tab:purple"),
                              ("ray_train", "Ray Train TorchTrainer", "tab:red")]:
        if (run := median_round(key, "recovery_s")) is None:
            continue
        kill_step = run["first_step_after_kill"] + run["committed_steps_lost"]
        times, steps = zip(*run["timeline"], strict=True)
        left.plot(times, [s - kill_step for s in steps], ".", ms=3, color=color,
                  label=f"{label}: {run['recovery_s']:.2f} s, {run['steps_redone']} redone")
    left.axvline(0, color="black", ls="--", lw=1, label="rank 1 SIGKILLed before step K")
    left.set(xlabel="seconds since the kill (median round)", ylabel="committed step - K",
             title=f"Recovery: Ray Train / ours = {summary['ray_train_over_ours_recovery']}x")
    left.legend(fontsize=8, loc="lower right")
    if (scale := median_round("scale_up", "scale_up_s")) is not None:
        plot_scale_up(middle, scale)
    if (drain := median_round("drain", "notice_to_step_without_node_s")) is not None:
        plot_drain(right, drain)
    loads = [r["load_average_at_start"][0] for r in rounds]
    fig.suptitle(f"{len(rounds)} rounds on a shared 2-core machine (1-min load average {min(loads):.0f}-"
                 f"{max(loads):.0f} at round starts)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_scale_up(axes: Any, scale: dict) -> None:
    for size, color in [(1, "tab:gray"), (2, "tab:blue")]:
        points = [(t, s) for t, s, w in scale["timeline"] if w == size]
        axes.plot(*zip(*points, strict=True), ".", ms=2, color=color, label=f"world size {size}")
    axes.axvline(0, color="black", ls="--", lw=1, label="blocker killed: resources appear")
    parts = scale["breakdown"]
    spawned = parts["slot_and_scaling_tick_s"]
    axes.axvspan(spawned, spawned + parts["actor_construction_s"], color="tab:orange", alpha=0.2,
                 label="new worker's actor starting")
    joined = spawned + parts["actor_construction_s"] + parts["tick_and_step_boundary_s"]
    axes.axvline(joined, color="tab:orange", lw=1, label="worker_joined (step boundary)")
    axes.set_xlim(-1, scale["scale_up_s"] + 3)
    axes.set_ylim(0, 1.1 * max(s for t, s, _ in scale["timeline"] if t <= scale["scale_up_s"] + 3))
    axes.set(xlabel="seconds since resources appeared", ylabel="committed step",
             title=f"Scale-up 1 -> 2 workers: {scale['scale_up_s']:.2f} s to the first 2-worker step")
    axes.legend(fontsize=8, loc="upper left")


def plot_drain(axes: Any, drain: dict) -> None:
    for size, color in [(2, "tab:blue"), (1, "tab:gray")]:
        points = [(t, s) for t, s, w in drain["timeline"] if w == size]
        axes.plot(*zip(*points, strict=True), ".", ms=2, color=color, label=f"world size {size}")
    parts = drain["breakdown"]
    axes.axvline(0, color="black", ls="--", lw=1, label="drain_node: the preemption notice")
    axes.axvline(parts["noticed_s"], color="tab:orange", lw=1, label="node_draining (Controller's poll)")
    axes.axvline(parts["noticed_s"] + parts["step_boundary_s"], color="tab:purple", lw=1,
                 label="drained (step boundary)")
    lost = max(drain["steps_lost_event"], drain["steps_lost_history"])
    axes.set(xlabel="seconds since the notice (median round)", ylabel="committed step",
             title=f"Drain notice: {drain['notice_to_step_without_node_s']:.2f} s to a step without the node, "
                   f"{lost} lost")
    axes.legend(fontsize=8, loc="upper left")
