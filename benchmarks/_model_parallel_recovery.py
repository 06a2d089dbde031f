"""The recovery half of benchmarks/model_parallel.py: one of 4 workers SIGKILLed at (dp2, pp2) and at (dp2, tp2),
three ways, each the same job: the GPT recipe under zero3 with two replica groups (``strategy.replicas: 2``, HSDP:
each data-parallel copy of the model whole over its pp x tp workers, torchft's FT-HSDP layout), a checkpoint
every ``CHECKPOINT_EVERY`` steps:

- **ours**: the run goes on from the survivors' memory, at the layout the survivors allow;
- **checkpoint restart** (what Varuna and DeepSpeed's universal checkpointing do): the run ends at the kill
  (``failure.max_failures: 0``) and the same job starts again, resuming from its newest checkpoint;
- **replica-group restart** (torchft's recovery of a lost TP or PP rank): the lost rank's whole replica group
  (its pipeline's or tp group's workers) goes, the other replica group goes on from memory, and new workers
  come back for the group. Emulated with our own run: the group's other ranks are killed with the lost one.

Each reports the time from the kill (the commit of step K-1, the last step before the killed rank's step K) to
the next committed step, the committed steps redone, samples/s after the loss against before (the generation
right after it, until any worker joins), and what moved (our ``generation_formed``'s ``moved_bytes``) against
the lost rank's part (its parameters' and optimizer state's bytes in ``result.json``'s memory).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from benchmarks._recovery_helpers import recovery_breakdown, summarize_failure
from raylastic.actors.status.run import RunFailed
from raylastic.cluster.job import train
from raylastic.jobconfig import job_config_from_dict
from raylastic.strategies.parallel_layout import ParallelLayout

CHECKPOINT_EVERY = 10
KILLED_RANK = 1
WAYS = ("ours", "checkpoint restart", "replica-group restart")


def replica_group(parallel: dict, num_workers: int, rank: int) -> list[int]:
    """The ranks of ``rank``'s replica group: every rank that holds the same copy of the model (its pipeline
    and tp group), torchft's unit of restart."""
    tp, pp = parallel.get("tp", 1), parallel.get("pp", 1)
    layout = ParallelLayout(pp=pp, dp_replicate=num_workers // (tp * pp), tp=tp)
    mine = layout.coordinates(rank)
    return [r for r in range(num_workers) if layout.coordinates(r).dp_replicate == mine.dp_replicate]


def measure(way: str, sections: dict, run_dir: Path, *, kill_step: int, num_workers: int) -> dict:
    """One kill, ``way`` (one of WAYS)."""
    victims = (replica_group(sections["parallel"], num_workers, KILLED_RANK) if way == "replica-group restart"
               else [KILLED_RANK])
    sections = {**sections, "name": f"mpr-{run_dir.name}", "strategy": {"name": "zero3", "replicas": 2},
                "scaling": {**sections["scaling"], "min_workers": 2},  # the survivors go on without a replacement
                "checkpoint": {**sections.get("checkpoint", {}), "every_steps": CHECKPOINT_EVERY},
                "faults": [{"action": "kill", "rank": rank, "step": kill_step} for rank in victims]}
    if way == "checkpoint restart":
        return _restart(sections, run_dir, kill_step)
    started = time.time()
    result = train(job_config_from_dict(sections), run_dir=run_dir)
    commits = sorted(((row["step"], started + row["time_s"]) for row in result.history), key=lambda c: c[1])
    formed = [e for e in result.events if e.type == "generation_formed"]
    after = formed[1]
    lost_bytes = (result.memory[KILLED_RANK]["parameters"] + result.memory[KILLED_RANK]["optimizer"]
                  if result.memory and len(result.memory) > KILLED_RANK else None)  # its part, as held at the end
    until = formed[2].time_s if len(formed) > 2 else float("inf")
    failed = next(e for e in result.events if e.type == "worker_failed")
    return {**_timing(commits, kill_step), **recovery_breakdown(commits, kill_step, started, failed, after),
            **_throughput([row for row in result.history if row["step"] < kill_step],
                          [row for row in result.history if after.time_s < row["time_s"] < until]),
            "layout_after": after.details.get("layout"), "state_source": after.details["state_source"],
            "moved_bytes": after.details.get("moved_bytes"), "lost_rank_bytes": lost_bytes}


def _restart(sections: dict, run_dir: Path, kill_step: int) -> dict:
    """The run ends at the kill; the same job again resumes from its newest checkpoint."""
    first_started = time.time()
    try:
        train(job_config_from_dict({**sections, "failure": {**sections.get("failure", {}), "max_failures": 0}}),
              run_dir=run_dir)
        raise RuntimeError("the run survived a kill with failure.max_failures: 0")
    except RunFailed:
        pass
    first = json.loads((run_dir / "result.json").read_text())["history"]
    again_started = time.time()
    again = {**sections, "faults": [], "checkpoint": {**sections["checkpoint"], "resume": "auto"}}
    result = train(job_config_from_dict(again), run_dir=run_dir)
    commits = sorted([(row["step"], first_started + row["time_s"]) for row in first] +
                     [(row["step"], again_started + row["time_s"]) for row in result.history], key=lambda c: c[1])
    return {**_timing(commits, kill_step), **_throughput(first, result.history),
            "layout_after": result.history[0].get("layout"), "state_source": "checkpoint",
            "moved_bytes": None, "lost_rank_bytes": None}


def _timing(commits: list[tuple[int, float]], kill_step: int) -> dict:
    summary = summarize_failure(commits, kill_step)
    return {key: summary[key] for key in ("recovery_s", "committed_steps_lost", "steps_redone")}


def _throughput(before: list[dict], after: list[dict]) -> dict:
    """Median samples/s of the history rows ``before`` the kill (less the first 3 steps) and ``after`` it (the
    generation right after the loss, less its first step)."""
    median_before = statistics.median(row["samples_per_s"] for row in before[3:])
    median_after = statistics.median(row["samples_per_s"] for row in after[1:]) if after[1:] else None
    return {"samples_per_s_before": median_before, "samples_per_s_after": median_after,
            "after_over_before": round(median_after / median_before, 3) if median_after else None}
