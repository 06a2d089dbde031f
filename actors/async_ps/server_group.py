"""The run's parameter servers as one: starting and replacing them, and every call to them, each with a bound.

Nothing here waits on a server without a limit (issue 29): a server that is alive but stopped (SIGSTOP, a
frozen VM) answers nothing, and a call it leaves unanswered for its bound - ``failure.step_timeout_s``, or
``scaling.placement_timeout_s`` for a restore, which may include starting the server - makes it lost, like a
dead one. Fetching an answer (the parameters: megabytes) takes at most ``failure.collective_timeout_s`` more.
An error a server raised itself fails the run with it (``ServerFailed`` carries the traceback of the update
that raised)::

    group = ServerGroup(job, checkpoint_root, shards, prefix="raylastic:x:", place=lambda index: None)
    beats = group.ask("beat")           # one answer per server; ServersLost names those that gave none
    group.replace(1)                    # kill server 1 and start a new one in its place
    group.restore(epoch=2, cut=None)    # every server to the initial state, writing checkpoints as a new lineage
    group.saved(directory, version=40)  # True once every server's file of version 40 is written (from heartbeats)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylastic.actors.async_ps.checkpoints import Cut, clear_after
from raylastic.actors.async_ps.heartbeats import Heard
from raylastic.actors.async_ps.saver import SaveFailure, SaveStillWriting
from raylastic.actors.async_ps.server import (
    ParameterServerActor,
    Restored,
    ServerBeat,
    ServerFailed,
    ServerSpec,
    UnreadableCheckpoint,
)
from raylastic.actors.async_ps.shards import merged_shares
from raylastic.actors.processes.setup_hook import TRAINS
from raylastic.actors.status.run import RunFailed
from raylastic.jobconfig import JobConfig


class ServersLost(Exception):
    """Servers that died, or did not answer a call within its bound: the Controller replaces them and restores."""

    def __init__(self, servers: list[tuple[int, str]]) -> None:
        super().__init__(servers)
        self.servers = servers
        """(index, why) of each."""


class ServerGroup:
    def __init__(self, job: JobConfig, checkpoint_root: str, shards: tuple[tuple[str, ...], ...], *, prefix: str,
                 place: Callable[[int], PlacementGroupSchedulingStrategy | None]) -> None:
        """``place(index)``: where server ``index`` goes (None: wherever Ray finds its resources)."""
        self.job, self.checkpoint_root, self.shards = job, checkpoint_root, shards
        self.prefix, self.place = prefix, place
        self.faults = [f for f in job.faults if f.action == "kill_server"]
        """kill_server faults that have not fired yet."""
        self.servers = [self._start(index) for index in range(job.strategy.num_servers)]
        self.epoch = 0
        self.lineage = ""
        """The tag of this epoch's checkpoint files (checkpoints.py)."""
        self.written: dict[int, int] = {}
        """Server -> the newest version it wrote (or was restored to) in this epoch."""
        self.failed_saves: set[str] = set()
        """The files whose save failed."""
        self.unreported: list[tuple[int, SaveFailure]] = []
        """(server, save) for the failed saves not yet taken (``take_failed_saves``)."""

    def restore(self, epoch: int, cut: Cut | None) -> Restored:
        """Every server to ``cut`` (None: the initial state) as epoch ``epoch``, its saves a new lineage; then the
        files of the abandoned timeline, after the cut, are cleared."""
        self.lineage = f"{time.time_ns():016x}"  # later epochs sort higher, in this run and the next
        restored = self.ask("restore", epoch, cut, self.lineage)[0]
        self.epoch = epoch
        self.written = dict.fromkeys(range(len(self.servers)), restored.version)
        clear_after(self.checkpoint_root, restored.version)
        return restored

    def pings(self) -> dict[str, Any]:
        """The heartbeat method of every server, by the name ``hear`` knows it by."""
        return {f"server{index}": server.beat for index, server in enumerate(self.servers)}

    def hear(self, heard: Heard) -> None:
        """What the heartbeats said (``pings``): RunFailed for an error a server raised, ServersLost for the lost."""
        names = {f"server{index}": index for index in range(len(self.servers))}
        for name, error in heard.raised.items():
            if name in names:
                raise self.failed(names[name], error)
        for name, beat in heard.answers.items():
            if name in names:
                self._take_in(names[name], beat)
        if lost := [(index, heard.late[name]) for name, index in names.items() if name in heard.late]:
            raise ServersLost(lost)

    def beats(self) -> list[ServerBeat]:
        """Every server's heartbeat now (``ask``), taken in."""
        beats = self.ask("beat")
        for index, beat in enumerate(beats):
            self._take_in(index, beat)
        return beats

    def take_failed_saves(self) -> list[tuple[int, SaveFailure]]:
        """(server, save) for each save that failed since the last call."""
        failed, self.unreported = self.unreported, []
        return failed

    def _take_in(self, index: int, beat: ServerBeat) -> None:
        """Server ``index``'s heartbeat: how far its saves got, and which failed."""
        self.failed_saves.update(failure.path for failure in beat.failed_saves)
        self.unreported += [(index, failure) for failure in beat.failed_saves]
        if beat.epoch == self.epoch:
            self.written[index] = beat.written

    def saved(self, directory: str, version: int) -> bool | None:
        """Whether every server wrote ``version`` to ``directory`` in this epoch: None while they write, False if one
        of the files failed."""
        if self.failed_saves.intersection(Cut(directory, version, self.lineage, len(self.servers)).files()):
            return False
        if all(written >= version for written in self.written.values()):
            return True
        return None

    def ask(self, method: str, *args: Any) -> list[Any]:
        """Every server's answer to ``method(*args)``, in server order, waited for at most the method's bound.
        ServersLost for those that died or did not answer (or whose restore found a save of theirs still being
        written past its bound: SaveStillWriting); RunFailed for an error a server raised (a file of a cut that
        cannot be loaded: UnreadableCheckpoint, so that an older cut is tried)."""
        timeout_s, field = self._bound(method)
        refs = [getattr(server, method).remote(*args) for server in self.servers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)  # answered, not fetched
        answers, lost = [], []
        for index, ref in enumerate(refs):
            if ref not in ready:
                lost.append((index, f"no answer to {method} for {timeout_s:g}s ({field})"))
                continue
            try:
                answers.append(ray.get(ref, timeout=self.job.failure.collective_timeout_s))
            except ray.exceptions.RayTaskError as error:
                if isinstance(error.cause, UnreadableCheckpoint):
                    raise error.cause from None
                if isinstance(error.cause, SaveStillWriting):  # stuck on its disk, not wrong: a new one is started
                    lost.append((index, str(error.cause)))
                    continue
                raise self.failed(index, error) from None
            except ray.exceptions.RayError as error:
                lost.append((index, first_line(error)))
        if lost:
            raise ServersLost(lost)
        return answers

    def state(self) -> dict[str, torch.Tensor]:
        """The servers' parameters and buffers now, by their names in the model."""
        return merged_shares(self.ask("state"))

    def failed(self, index: int, error: ray.exceptions.RayTaskError) -> RunFailed:
        """The run's failure for an error that server ``index`` raised (its traceback included)."""
        if isinstance(error.cause, ServerFailed):
            return RunFailed(f"{error.cause.summary}\n{error.cause.details}")
        return RunFailed(f"parameter server {index} raised {error.cause!r}\n{error}")

    def _bound(self, method: str) -> tuple[float, str]:
        """How long ``method`` may take, and the setting that says so."""
        if method == "restore":  # a new server's start (importing torch, building the model) and reading a cut
            return self.job.scaling.placement_timeout_s, "scaling.placement_timeout_s"
        return self.job.failure.step_timeout_s, "failure.step_timeout_s"

    def replace(self, index: int) -> None:
        """Kill server ``index`` (dead, stopped or hung) and start a new one in its place."""
        ray.kill(self.servers[index])
        self.faults = [f for f in self.faults if f.rank != index]  # it fired
        self.servers[index] = self._start(index)

    def kill_all(self) -> None:
        for server in self.servers:
            ray.kill(server)

    def _start(self, index: int) -> Any:
        job = self.job
        spec = ServerSpec(workload=job.workload, optim=job.optim, training=job.training,
                          max_staleness=job.strategy.max_staleness, num_servers=job.strategy.num_servers,
                          predict_weights=job.strategy.predict_weights,
                          checkpoint_root=self.checkpoint_root, every_steps=job.checkpoint.every_steps,
                          config_hash=job.math_hash(), torch_threads=max(1, int(job.strategy.server_cpus)),
                          faults=tuple(f for f in self.faults if f.rank == index),
                          save_wait_s=job.scaling.placement_timeout_s / 2)
        return ParameterServerActor.options(
            name=f"{self.prefix}server{index}", num_cpus=job.strategy.server_cpus, max_restarts=0,
            scheduling_strategy=self.place(index), runtime_env=TRAINS,
        ).remote(spec, index=index, names=list(self.shards[index]))


def first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
