"""A fake WorkerGroup for the Controller's state-machine tests: no Ray, no processes, no sleeps.

It plays a group whose members train one step per poll. A test scripts what goes wrong:

    group = FakeGroup(workers=2)
    group.fail("join", MembersFailed([LostWorker("w1", "actor died", 1)]))   # the next join raises it
    group.on_poll(lambda status: ...)                                        # rewrite the next poll's status
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from raylastic.actors.controller.controller import Controller
from raylastic.actors.controller.policies import RunPolicies
from raylastic.actors.controller.states import Failed, Finished, Running, RunState, Stopped
from raylastic.actors.processes.setup_hook import Warmth
from raylastic.actors.status.group import GroupStatus, LostWorker, MemberStatus, RankNews
from raylastic.actors.status.worker import StepResult, WorkerStatus
from raylastic.actors.worker.actor import JoinReport
from raylastic.actors.worker_group.group import MembersFailed
from raylastic.strategies.build import build_strategy
from raylastic.strategies.checkpoint_manifest import CheckpointManifest, write_manifest
from raylastic.strategies.peer_restore import PeerRestorePlan
from tests.support.helpers import job


class FakeGroup:
    def __init__(self, workers: int = 2, *, placeable: int | None = None, free_slots: int = 0, idle_spares: int = 0,
                 checkpoint_root: Path | None = None, config_hash: str = "", replicated: bool = True) -> None:
        """``placeable``: how many of the first workers start (default all); ``free_slots``: workers a later
        ``grow`` can start; ``idle_spares``: warm spares started with the group;
        ``replicated``: members keep their state across a join (else step 0)."""
        self.members = [f"w{i}" for i in range(workers)]
        self.placeable = workers if placeable is None else placeable
        self.free_slots = free_slots
        self.idle: list[str] = [f"spare{i}" for i in range(idle_spares)]
        """Warm spares, constructed and idle."""
        self.ready: list[str] = []
        self.draining: set[str] = set()
        self.generation = -1
        self.steps = {name: 0 for name in self.members}
        """Each member's committed step."""
        self.until_step = 0
        self.phase: dict[str, str] = {}
        self.calls: list[str] = []
        """Every call the Controller made, in order ("join", "restore", "train", "poll", ...)."""
        self.failures: dict[str, list[Exception]] = {}
        self.poll_rewrites: list[Callable[[GroupStatus], GroupStatus]] = []
        self.checkpoint_root = checkpoint_root
        self.config_hash = config_hash
        self.stop_at_boundary = False
        self.shard_copies: list | None = None
        self.cpu_s = 0.0
        """This thread's CPU time spent playing the members' side (polls, joins, ends): not the Controller's."""
        self.refused: dict[str, str] = {}
        """Checkpoints whose loaders find a file altered -> why (``restore`` refuses them)."""
        self.start_failures: list = []
        """StartFailures to report (``take_start_failures``)."""
        """What each member reports it kept of sharded state at the next join (None: nothing)."""
        self.nodes: dict[str, str] = {}
        """Member name -> node id (none by default)."""
        self.draining_nodes: dict[str, float | None] = {}
        """What Ray reports as draining, for every poll."""
        self.replicated = replicated
        self.shut_down = False
        self.layout = None
        """The generation's model-parallel layout: the fake forms data-parallel generations only."""
        self._spawned = workers

    # -- scripting ------------------------------------------------------------------------------------------
    def fail(self, method: str, error: Exception) -> None:
        """The next call of ``method`` raises ``error``."""
        self.failures.setdefault(method, []).append(error)

    def on_poll(self, rewrite: Callable[[GroupStatus], GroupStatus]) -> None:
        """The next poll's status goes through ``rewrite``."""
        self.poll_rewrites.append(rewrite)

    def _call(self, method: str) -> None:
        self.calls.append(method)
        if self.failures.get(method):
            raise self.failures[method].pop(0)

    # -- the WorkerGroup interface --------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def member_names(self) -> list[str]:
        return list(self.members)

    num_joining = 0
    """Joiners are ready as soon as they are started."""

    def place(self, *, max_workers: int, min_workers: int, timeout_s: float,
              spare_workers: int = 0) -> list[LostWorker]:
        self._call("place")
        lost = [LostWorker(name, "not started within scaling.placement_timeout_s") for name in
                self.members[self.placeable:]]
        self.members = self.members[:self.placeable]
        return lost

    def capacity_note(self) -> str:
        return "(each needs {'CPU': 1})"

    def form(self, *, run_step: int, layout=None) -> list[JoinReport]:
        assert layout is None, "the fake group forms data-parallel generations only"
        self._call("join")
        self.generation += 1
        with self._members_work():
            copies = self.shard_copies or [()] * self.size
            if not self.replicated:  # sharded state is built afresh for every group
                self.steps = dict.fromkeys(self.members, 0)
            return [JoinReport(node_id="node", step=self.steps.setdefault(name, 0), shard_copies=held)
                    for name, held in zip(self.members, copies, strict=True)]

    def sync_state(self, *, source_rank: int) -> None:
        self._call("sync_state")
        source = self.members[source_rank]
        self.steps = {name: self.steps[source] for name in self.members}

    def restore_from_peers(self, plan: PeerRestorePlan) -> None:
        self._call("restore_from_peers")
        self.steps = dict.fromkeys(self.members, plan.step)

    def restore(self, path: str, step: int) -> str | None:
        self._call("restore")
        if path in self.refused:
            return self.refused[path]
        self.steps = dict.fromkeys(self.members, step)
        return None

    def save_checkpoint(self) -> str:
        self._call("save_checkpoint")
        return self._save()

    def full_model_file(self, *, replicated: bool) -> bytes:
        self._call("full_model_file")
        return b"model.pt"

    def evaluate(self) -> dict[str, float]:
        self._call("evaluate")
        return {"accuracy": 0.9}

    def memory(self) -> list[dict[str, int]]:
        self._call("memory")
        return [{"parameters": 1}] * self.size

    def start_training(self, until_step: int, faults: list, shares: tuple[int, ...] | None = None) -> None:
        self._call("train")
        self.until_step = until_step
        self.phase = {name: "training" for name in self.members}
        self.stop_at_boundary = False

    def poll(self) -> GroupStatus:
        self._call("poll")
        with self._members_work():
            news = []
            for rank, name in enumerate(self.members):
                if self.phase[name] != "training":
                    continue
                if self.steps[name] >= self.until_step:
                    self.phase[name] = "finished"
                elif self.stop_at_boundary:
                    self.phase[name] = "stopped"
                else:
                    self.steps[name] += 1
                    result = StepResult(step=self.steps[name], loss_sum=1.0, samples=4, duration_s=0.01,
                                        finished_at=time.time())
                    news.append(RankNews(rank, WorkerStatus(self.phase[name], self.steps[name], [result])))
            status = self._status(tuple(news))
            while self.poll_rewrites:
                status = self.poll_rewrites.pop(0)(status)
            return status

    def end_generation(self) -> GroupStatus:
        self._call("end_generation")
        with self._members_work():
            return self._status(())

    def request_boundary(self) -> None:
        self.stop_at_boundary = True

    def drain(self, *, rank: int | None = None, node_id: str | None = None, replace: bool = False) -> list[str]:
        names = {name for r, name in enumerate(self.members)
                 if r == rank or (node_id is not None and self.nodes.get(name) == node_id)}
        self.draining |= names
        if replace:
            self.calls.append(f"drain {node_id} and replace")
        return sorted(names)

    @property
    def num_leaving(self) -> int:
        return len(self.draining)

    def undrain(self, *, node_id: str) -> None:
        self.draining -= {name for name in self.members if self.nodes.get(name) == node_id}

    def grow(self, members: int, *, spares: int = 0, wait_s: float = 0.0) -> int:
        taken, self.idle = self.idle[:max(members, 0)], self.idle[max(members, 0):]
        self.ready += taken + self._start(members - len(taken))  # constructed at once
        self.idle += self._start(spares)
        return len(taken)

    def _start(self, count: int) -> list[str]:
        started = [f"w{self._spawned + i}" for i in range(min(max(count, 0), self.free_slots))]
        self.free_slots -= len(started)
        self._spawned += len(started)
        return started

    @property
    def num_spares_ready(self) -> int:
        return len(self.idle)

    def take_start_failures(self) -> list:
        taken, self.start_failures = self.start_failures, []
        return taken

    def admit_ready_joiners(self) -> dict[str, Warmth]:
        self._call("admit_ready_joiners")
        admitted, self.ready = self.ready, []
        self.members += admitted
        return dict.fromkeys(admitted, Warmth())

    def release_departed(self) -> None:
        pass

    def remove_drained(self, *, hand_over: bool = False) -> dict[str, str]:
        leaving = {name: self.nodes.get(name, "") for name in self.members if name in self.draining}
        self.members = [name for name in self.members if name not in self.draining]
        self.draining = set()
        return leaving

    def drop(self, name: str) -> None:
        self.calls.append(f"drop {name}")
        self.members = [m for m in self.members if m != name]
        self.steps.pop(name, None)

    def shutdown(self) -> None:
        self.shut_down = True

    # -- helpers --------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _members_work(self) -> Iterator[None]:
        """Counts this thread's CPU time in the block as the members' (``cpu_s``)."""
        started = time.thread_time()
        try:
            yield
        finally:
            self.cpu_s += time.thread_time() - started

    def _status(self, news: tuple[RankNews, ...]) -> GroupStatus:
        return GroupStatus(generation=self.generation, news=news,
                           members=tuple(MemberStatus(name, phase=self.phase.get(name, "training"),
                                                      node_id=self.nodes.get(name, "")) for name in self.members),
                           num_joiners_ready=len(self.ready), draining=bool(self.draining),
                           num_spares=len(self.idle), num_spares_ready=len(self.idle), num_placeable=self.free_slots,
                           draining_nodes=dict(self.draining_nodes))

    def _save(self) -> str:
        step = max(self.steps.values())
        directory = self.checkpoint_root / f"step_{step:08d}"
        write_checkpoint(directory, step, self.size, self.config_hash)
        return str(directory)


def write_checkpoint(directory: Path, step: int, world_size: int, config_hash: str) -> None:
    """A small real DCP checkpoint with its manifest: the Controller verifies it, the fake workers never load it."""
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"weight": torch.zeros(2)}, checkpoint_id=str(directory))
    write_manifest(str(directory), CheckpointManifest(step=step, world_size=world_size, strategy="fake",
                                                      samples_consumed=0, config_hash=config_hash))


def with_member(status: GroupStatus, name: str, **changes: object) -> GroupStatus:
    """``status`` with member ``name``'s status changed."""
    return replace(status, members=tuple(replace(m, **changes) if m.name == name else m for m in status.members))


STEPS = 6
"""Steps of the jobs the state-machine tests run."""


def controller(tmp_path, *overrides: str, policies: RunPolicies | None = None,
               **group_options) -> tuple[Controller, FakeGroup]:
    config = job(f"training.steps={STEPS}", "checkpoint.every_steps=0", *overrides)
    group = FakeGroup(checkpoint_root=tmp_path, config_hash=config.math_hash(),
                      replicated=build_strategy(config.strategy).replicated, **group_options)
    return Controller(config, str(tmp_path), group=group, policies=policies), group


def advance(run: Controller) -> RunState:
    """One transition, but a training generation's polls taken together: from a running generation that has
    started, the state after it."""
    state = run.advance()
    while isinstance(state, Running) and state.started:
        state = run.advance()
    return state


def states_until_end(run: Controller) -> list[str]:
    names = []
    while not isinstance(run.state, Finished | Failed | Stopped):
        names.append(advance(run).name)
    return names


def events(run: Controller, type_: str) -> list[dict]:
    return [e.to_dict() for e in run.log.events() if e.type == type_]


def lose(name: str, rank: int) -> MembersFailed:
    return MembersFailed([LostWorker(name, "actor died: killed", rank)])
