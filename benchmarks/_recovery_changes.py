"""The planned membership changes of benchmarks/recovery.py, followed from the driver: a scale-up when
resources appear (with or without a warm spare) and a preemption notice draining a node of a two-node
``ray.cluster_utils.Cluster``. Each takes the job (built by recovery.py) and returns a JSON-ready dict.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

import raylastic.cluster.job
from benchmarks import _recovery_helpers as helpers
from benchmarks.common import REPO_ROOT
from raylastic.actors.status.run import Event, RunFailed, RunStatus
from raylastic.cluster.connect import job_runtime_env
from raylastic.jobconfig import JobConfig
from raylastic.jobconfig.naming import NAMESPACE, controller_name, worker_name

DRAIN_DEADLINE_S = 60
LINGER_S = 3.0  # a run followed until a change is stopped this long after it is seen: what the plot shows
GIVE_UP_S = 120.0  # ... or this long after the driver acted, if the change never comes


@dataclass
class Followed:
    """What a followed run left: its history rows and events (a run stopped once measured has no RunResult)."""

    history: list[dict[str, Any]]
    events: list[Event]


class Follower:
    """train()'s on_progress: learns the Controller's clock origin; once ``ready(progress)``, calls ``act``
    (kill a blocker, drain a node) and notes the driver's time just before it. With ``changed``, the run is
    stopped (at a step boundary) LINGER_S after a progress shows the change, so its length does not depend on
    how long the change took on a busy machine."""

    def __init__(self, name: str, act: Callable[[], None] | None = None,
                 ready: Callable[[RunStatus], bool] = lambda progress: False,
                 changed: Callable[[RunStatus], bool] | None = None) -> None:
        self.name, self.act, self.ready, self.changed = name, act, ready, changed
        self.controller: Any = None
        self.origin: float | None = None
        self.acted_at: float | None = None
        self.changed_at: float | None = None
        self.stopped = False

    def __call__(self, progress: RunStatus) -> None:
        if self.controller is None:  # RunLog.started: the time_s of history and events count from it
            self.controller = ray.get_actor(controller_name(self.name))
            self.origin = ray.get(self.controller.__ray_call__.remote(lambda c: c.log.started))
        if self.act is not None and self.acted_at is None and self.ready(progress):
            self.acted_at = time.time()
            self.act()
        elif self.acted_at is not None and self.changed is not None and not self.stopped:
            if self.changed_at is None and self.changed(progress):
                self.changed_at = time.time()
            now = time.time()
            if now - (self.changed_at or now) >= LINGER_S or now - self.acted_at >= GIVE_UP_S:
                self.controller.stop.remote()
                self.stopped = True


def watch_actor(name: str, marks: dict[str, float], done: threading.Event) -> None:
    """Driver-side times of a worker: its actor created by the Controller (``spawned``), then constructed."""
    while not done.is_set():
        try:
            actor = ray.get_actor(name)
        except ValueError:
            time.sleep(0.01)
            continue
        marks["spawned"] = time.time()
        ray.get(actor.pid.remote())
        marks["constructed"] = time.time()
        return


def follow_run(job: JobConfig, run_dir: Path, follow: Follower, watched: str | None = None) -> tuple[Followed, dict]:
    """``cluster.job.train`` with ``follow``; the driver-side marks of the worker named ``watched``."""
    marks: dict[str, float] = {}
    done = threading.Event()
    if watched:
        threading.Thread(target=watch_actor, args=(watched, marks, done), daemon=True).start()
    try:
        result = raylastic.cluster.job.train(job, run_dir=run_dir, on_progress=follow)
        return Followed(result.history, result.events), marks
    except RunFailed:
        if not follow.stopped:
            raise
        record = json.loads((run_dir / "result.json").read_text())  # what the driver heard before the stop
        return Followed(record["history"], [Event.from_dict(e) for e in record["events"]]), marks
    finally:
        done.set()


def membership_events(events: list[Event]) -> list[dict]:
    return [e.to_dict() for e in events if e.type != "checkpointed"]


def first(events: list[Event], type_: str, after_s: float = float("-inf")) -> Event:
    found = next((e for e in events if e.type == type_ and e.time_s >= after_s), None)
    if found is None:
        raise RuntimeError(f"no {type_} event after {after_s:.3f} s: {[e.type for e in events]}")
    return found


def run_scale_up(job: JobConfig, run_dir: Path, release_at_step: int) -> dict:
    """Resources for the second worker appear (a 1-CPU blocker killed) -> the first step at world size 2.
    With ``scaling.spare_workers`` the job has a CPU more from the start, for the spare."""
    spares = job.scaling.spare_workers
    blocker = ray.remote(num_cpus=1)(helpers.Blocker).remote()  # holds the second worker's CPU
    ray.get(blocker.ready.remote())
    follow = Follower(job.name, act=lambda: ray.kill(blocker), ready=lambda p: p.step >= release_at_step,
                      changed=lambda p: p.world_size == 2)
    result, joiner = follow_run(job, run_dir, follow, watched=None if spares else worker_name(job.name, 2))
    origin, released = follow.origin, follow.acted_at
    if released is None:
        raise RuntimeError(f"the run ended before step {release_at_step}")
    early = next((r for r in result.history if r["world_size"] == 2 and r["time_s"] + origin < released), None)
    if early is not None:  # the second worker came before the resources did: see "scale_up_spare" in recovery.py
        return {"status": "no scale-up", "world_size_at_first_step": result.history[0]["world_size"],
                "world_size_2_at_step": early["step"], "world_size_2_before_release_s": round(released - origin
                                                                                             - early["time_s"], 4),
                "spares_taken": [e.to_dict() for e in result.events if e.type == "spares_taken"],
                "events": membership_events(result.events)}
    first_two = next((r for r in result.history if r["world_size"] == 2), None)
    if first_two is None:
        raise RuntimeError(f"no step at world size 2 within {GIVE_UP_S} s of the release (or --scale-up-steps)")
    joined = first(result.events, "worker_joined")
    formed = [e for e in result.events if e.type == "generation_formed"][-1]
    at = {"joined": joined.time_s + origin - released, "formed": formed.time_s + origin - released,
          "first_step": first_two["time_s"] + origin - released}
    if spares:  # the spare is built: it is taken at the scaling check, then joins at the step boundary
        taken = first(result.events, "spares_taken", after_s=released - origin)
        breakdown = {"scaling_tick_s": taken.time_s + origin - released,
                     "step_boundary_s": at["joined"] - (taken.time_s + origin - released)}
    else:
        at |= {"spawned": joiner["spawned"] - released, "constructed": joiner["constructed"] - released}
        breakdown = {"slot_and_scaling_tick_s": at["spawned"],
                     "actor_construction_s": at["constructed"] - at["spawned"],
                     "tick_and_step_boundary_s": at["joined"] - at["constructed"]}
    breakdown |= {"generation_formed_s": at["formed"] - at["joined"], "first_step_s": at["first_step"] - at["formed"]}
    offset = origin - released
    return {"scale_up_s": round(at["first_step"], 4), "breakdown": {k: round(v, 4) for k, v in breakdown.items()},
            "timeline": [[round(r["time_s"] + offset, 4), r["step"], r["world_size"]] for r in result.history
                         if -1 <= r["time_s"] + offset <= at["first_step"] + 3],  # what the plot shows
            "events": membership_events(result.events)}


def run_drain(job: JobConfig, run_dir: Path, notice_at_step: int) -> dict:
    """A head and one more node, 1 CPU each, a worker on each; at a step, the driver drains the second node
    through the GCS as a preemption notice does -> the first step committed without it (world size 1)."""
    from ray.cluster_utils import Cluster

    two_nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        leaving = two_nodes.add_node(num_cpus=1)
        two_nodes.wait_for_nodes()
        ray.init(address=two_nodes.address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING,
                 runtime_env=job_runtime_env(str(REPO_ROOT)))
        try:
            notice = Follower(job.name, act=lambda: preemption_notice(two_nodes.address, leaving.node_id),
                              ready=lambda p: p.step >= notice_at_step and p.world_size == 2,
                              changed=lambda p: p.world_size == 1)
            result, _ = follow_run(job, run_dir, notice)
        finally:
            ray.shutdown()
    finally:
        two_nodes.shutdown()
    if notice.acted_at is None:
        raise RuntimeError(f"the run ended before step {notice_at_step} at world size 2")
    return summarize_drain(result, notice.origin, notice.acted_at, leaving.node_id)


def preemption_notice(gcs_address: str, node_id: str) -> None:
    """What ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds 60`` sends."""
    from ray.core.generated import autoscaler_pb2

    accepted, why = ray._raylet.GcsClient(address=gcs_address).drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), "benchmark: spot reclaimed",
        time.time_ns() // 1_000_000 + DRAIN_DEADLINE_S * 1000)
    if not accepted:
        raise RuntimeError(f"the drain was not accepted: {why}")


def summarize_drain(result: Followed, origin: float, noticed_at: float, node_id: str) -> dict:
    notice_s = noticed_at - origin  # on the run's clock
    draining = first(result.events, "node_draining", after_s=notice_s)
    drained = first(result.events, "drained", after_s=notice_s)
    formed = first(result.events, "generation_formed", after_s=drained.time_s)
    without = next((r for r in result.history if r["world_size"] == 1 and r["time_s"] > notice_s), None)
    if without is None:
        raise RuntimeError(f"no step without the drained node within {GIVE_UP_S} s of the notice")
    if draining.details["node_id"] != node_id or len(draining.details["workers"]) != 1:
        raise RuntimeError(f"expected one worker on the drained node {node_id}: {draining.to_dict()}")
    last_with = max(r["step"] for r in result.history if r["world_size"] == 2)
    steps = [r["step"] for r in result.history]
    breakdown = {"noticed_s": draining.time_s - notice_s, "step_boundary_s": drained.time_s - draining.time_s,
                 "generation_formed_s": formed.time_s - drained.time_s,
                 "first_step_s": without["time_s"] - formed.time_s}
    return {"notice_to_step_without_node_s": round(without["time_s"] - notice_s, 4),
            "steps_lost_event": drained.details["steps_lost"], "steps_lost_generation": formed.details["steps_lost"],
            "steps_lost_history": last_with + 1 - without["step"],
            "steps_committed_twice": len(steps) - len(set(steps)),
            "workers_failed": sum(e.type == "worker_failed" for e in result.events),
            "deadline_s": draining.details["deadline_s"], "notice_at_step": draining.step,
            "breakdown": {k: round(v, 4) for k, v in breakdown.items()},
            "timeline": [[round(r["time_s"] - notice_s, 4), r["step"], r["world_size"]] for r in result.history
                         if -1 <= r["time_s"] - notice_s <= without["time_s"] - notice_s + 2],
            "events": membership_events(result.events)}
