"""ParameterServer: one share of the parameters and their optimizer state, updated as gradients arrive.

Every server builds the whole model from the run seed (so all start from the same parameters) and the
job's optimizer over it, and owns the parameters ``shards.assign_parameters`` gives it: it serves and
updates only those (the optimizer skips parameters without a gradient). Server 0 also keeps the
model's buffers (BatchNorm statistics), the last pushed ones winning. With ``strategy.predict_weights`` a
pull serves the parameters extrapolated by the staleness recent updates had (prediction.py); updates
always apply to the parameters themselves.

Admitted gradients carry their update number; a server applies them strictly in that order (holding
back one that overtook an earlier one), so each server's version is the number of updates it applied
and the staleness checked here is exactly the one admitted. An update whose worker died before
pushing it is skipped (``skip``). Every ``checkpoint.every_steps`` updates the server writes its share
(on its saver's thread, saver.py) to ``<checkpoint root>/ps_<version>/server_<index>_of_<count>.<lineage>.pt``;
all servers of an epoch write at the same versions with the same lineage, so those files are one whole cut of
the state, loadable at any server count (``restore``; checkpoints.py).

An update that raises (an optimizer error, a gradient that does not fit, a staleness the admission should
have refused) fails the server for good: it applies nothing more and every later call raises the same
``ServerFailed``, with the traceback, which the Controller turns into the run's failure - nothing waits on
an update that will never come (issue 29)::

    server = ParameterServer(spec, index=0, names=["w", "b"])
    server.restore(epoch=1, cut=None, lineage="18f3a0c2d4e5f607")
    epoch, version, params = server.pull()
    server.push(epoch, update=1, read_version=0, gradients={"w": ..., "b": ...}, buffers={}, ticket=0)
"""

from __future__ import annotations

import copy
import os
import signal
import traceback
from dataclasses import dataclass
from typing import Any

import ray
import torch

from raylastic.actors.async_ps.checkpoints import Cut, checkpoint_dir, server_file
from raylastic.actors.async_ps.prediction import WeightPredictor
from raylastic.actors.async_ps.saver import SaveFailure, ServerSaver, Snapshot
from raylastic.actors.async_ps.server_files import UnreadableCheckpoint, read_server_file
from raylastic.actors.async_ps.shards import tied_names
from raylastic.actors.worker.optimizer_recipe import learning_rate, optimizer_factory, set_learning_rate
from raylastic.jobconfig import FaultConfig, OptimConfig, TrainingConfig, WorkloadConfig
from raylastic.workloads import load_workload


@dataclass(frozen=True, kw_only=True)
class ServerSpec:
    workload: WorkloadConfig
    optim: OptimConfig
    training: TrainingConfig
    max_staleness: int
    num_servers: int
    predict_weights: bool
    checkpoint_root: str
    every_steps: int
    config_hash: str
    torch_threads: int = 1
    faults: tuple[FaultConfig, ...] = ()
    """kill_server faults aimed at this server's index."""
    save_wait_s: float = 60.0
    """How long a restore waits for a save of the epoch before to end (half of scaling.placement_timeout_s, the
    restore's own bound: the server names the stuck file before the Controller gives up on it)."""


class StalenessViolation(RuntimeError):
    """A gradient older than max_staleness reached a server: a defect of the admission, never applied."""


class ServerFailed(RuntimeError):
    """An update raised on this server: it takes no further call. ``summary`` names the server and the update."""

    def __init__(self, summary: str, details: str) -> None:
        super().__init__(summary, details)
        self.summary, self.details = summary, details

    def __str__(self) -> str:
        return f"{self.summary}\n{self.details}"


@dataclass(frozen=True)
class ServerBeat:
    """A heartbeat's answer."""

    epoch: int
    version: int
    written: int
    """The newest version whose file this epoch wrote (or restored from)."""
    failed_saves: tuple[SaveFailure, ...] = ()
    """Saves that failed since the last heartbeat."""


@dataclass(frozen=True)
class Restored:
    version: int
    tickets: list[int]
    """The ticket of every update applied up to ``version``, in update order (-1: skipped)."""


class ParameterServer:
    def __init__(self, spec: ServerSpec, *, index: int, names: list[str]) -> None:
        torch.set_num_threads(spec.torch_threads)
        self.spec, self.index, self.names = spec, index, list(names)
        self.workload = load_workload(spec.workload.name, spec.workload.options)
        self.build_optimizer = optimizer_factory(spec.optim, getattr(self.workload, "configure_optimizer", None))
        self.epoch = 0
        self.lineage = ""
        self.max_applied_staleness = 0
        self.failure: ServerFailed | None = None
        self.saver = ServerSaver()
        self._reset()

    # -- what workers call ---------------------------------------------------------------------------------
    def pull(self) -> tuple[int, int, dict[str, torch.Tensor]]:
        """(epoch, version, this server's parameters - predicted where ``predict_weights`` - and buffers, on
        server 0)."""
        self._raise_if_failed()
        params = self.predictor.served(self.version) if self.predictor else self.params
        return self.epoch, self.version, self._served(params)

    def push(self, epoch: int, update: int, read_version: int, gradients: dict[str, torch.Tensor],
             buffers: dict[str, torch.Tensor], ticket: int) -> bool:
        """Take admitted update ``update`` (computed on this server's version ``read_version``); False when it
        belongs to an epoch before a restore (the worker fetches the servers again)."""
        self._raise_if_failed()
        if epoch != self.epoch:
            return False
        self.pending[update] = (read_version, gradients, buffers, ticket)
        self._apply_ready()
        return True

    # -- what the Controller calls -------------------------------------------------------------------------
    def skip(self, epoch: int, update: int) -> bool:
        """Update ``update``'s worker died: True if its gradient arrived here anyway, else it is skipped."""
        self._raise_if_failed()
        if epoch != self.epoch:
            return False
        if update <= self.version or update in self.pending:
            return True
        self.skipped.add(update)
        self._apply_ready()
        return False

    def restore(self, epoch: int, cut: Cut | None, lineage: str) -> Restored:
        """Start epoch ``epoch`` from ``cut`` (None: the run's initial state), writing its checkpoints as ``lineage``.
        A save of the epoch before is let end first: no file of it is written after this returns."""
        self._raise_if_failed()
        self.saver.reset(written=cut.version if cut else 0, timeout_s=self.spec.save_wait_s)
        self.epoch, self.lineage = epoch, lineage
        self._reset()
        if cut is not None:
            self._load(cut)
        self.submitted = self.version
        return Restored(self.version, list(self.tickets))

    def beat(self) -> ServerBeat:
        """A heartbeat, answered by the thread that applies updates (a stopped or stuck one answers nothing)."""
        self._raise_if_failed()
        return ServerBeat(self.epoch, self.version, self.saver.written, tuple(self.saver.take_failures()))

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> dict[str, int]:
        self._raise_if_failed()
        return {"version": self.version, "epoch": self.epoch, "max_applied_staleness": self.max_applied_staleness,
                "skipped_updates": self.skipped_count}

    def save(self) -> str:
        """Write this server's share at its version now (the end of the run), unless this epoch already did or
        was restored there; returns the checkpoint directory. Heartbeats say when the file is written."""
        self._raise_if_failed()
        if self.submitted != self.version:
            self._submit_save()
        return checkpoint_dir(self.spec.checkpoint_root, self.version)

    def state(self) -> dict[str, torch.Tensor]:
        """This server's share of the final model (parameters; buffers on server 0)."""
        self._raise_if_failed()
        return {name: tensor.detach().clone() for name, tensor in self._served().items()}

    # -- inside ---------------------------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _reset(self) -> None:
        torch.manual_seed(self.spec.training.seed)  # the same initial parameters on every server
        self.model = self.workload.build_model()
        self.optimizer = self.build_optimizer(self.model)
        self.params = {name: p for name, p in self.model.named_parameters() if name in set(self.names)}
        self.predictor = WeightPredictor(self.params) if self.spec.predict_weights else None
        self.version = 0
        self.submitted = 0
        """The newest version handed to the saver (or restored)."""
        self.tickets: list[int] = []
        """The ticket of every update this server applied (-1: skipped), in update order."""
        self.pending: dict[int, tuple[int, dict, dict, int]] = {}
        self.skipped: set[int] = set()
        self.skipped_count = 0

    def _served(self, params: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """This server's parameters (or ``params`` in their place), and the buffers on server 0."""
        served = dict(self.params if params is None else params)
        if self.index == 0:
            served |= {f"buffer.{name}": b for name, b in self.model.named_buffers()}
        return served

    def _apply_ready(self) -> None:
        try:
            while True:
                following = self.version + 1
                if following in self.skipped:
                    self.skipped.discard(following)
                    self.skipped_count += 1
                    if self.predictor:
                        self.predictor.before_update()  # no change to extrapolate
                    self._advance(-1)
                elif following in self.pending:
                    self._apply(following, *self.pending.pop(following))
                else:
                    return
        except Exception as error:
            self.failure = ServerFailed(f"parameter server {self.index} failed applying update {self.version + 1}: "
                                        f"{type(error).__name__}: {error}", traceback.format_exc())
            raise self.failure from error

    def _apply(self, update: int, read_version: int, gradients: dict, buffers: dict, ticket: int) -> None:
        if any(f.step == update for f in self.spec.faults):
            os.kill(os.getpid(), signal.SIGKILL)  # an injected server crash, before the update is applied
        staleness = self.version - read_version
        if staleness > self.spec.max_staleness:
            raise StalenessViolation(f"update {update} was computed on version {read_version} of server "
                                     f"{self.index}, {staleness} updates old (strategy.max_staleness="
                                     f"{self.spec.max_staleness})")
        self.max_applied_staleness = max(self.max_applied_staleness, staleness)
        if self.predictor:
            self.predictor.before_update()
            self.predictor.observe(staleness)
        if gradients:  # none: an inf/NaN step skipped under training.on_nonfinite=skip
            for name, param in self.params.items():
                param.grad = gradients[name].to(param.dtype)
            set_learning_rate(self.optimizer, learning_rate(update - 1, self.spec.optim, self.spec.training.steps))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])
        self._advance(ticket)

    def _advance(self, ticket: int) -> None:
        self.version += 1
        self.tickets.append(ticket)
        if self.spec.every_steps and self.version % self.spec.every_steps == 0:
            self._submit_save()

    def _submit_save(self) -> None:
        """A copy of this server's share at its version, to be written by the saver's thread."""
        payload = {"config_hash": self.spec.config_hash, "version": self.version, "lineage": self.lineage,
                   "tickets": list(self.tickets),
                   "params": {n: p.detach().clone() for n, p in self._served().items()},
                   "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                   "prediction": self.predictor.state_dict() if self.predictor else {}}
        if self.index == 0:
            payload["tied"] = tied_names(self.model)
        directory = checkpoint_dir(self.spec.checkpoint_root, self.version)
        path = server_file(directory, self.index, self.spec.num_servers, self.lineage)
        self.saver.submit(Snapshot(self.version, path, payload))
        self.submitted = self.version

    def _load(self, cut: Cut) -> None:
        """Every file of ``cut`` (whatever the server count that wrote it): this server's parameters, their optimizer
        state and the prediction state. Each file is checked against its name: one lineage, one version."""
        merged_state: dict[int, Any] = {}
        groups = None
        entries: dict[str, torch.Tensor] = {}
        previous: dict[str, torch.Tensor] = {}
        expected_staleness = 0.0
        for name in cut.files():
            saved = read_server_file(name)
            if saved["config_hash"] != self.spec.config_hash:
                raise ValueError(f"{name} was saved by another job (config hash {saved['config_hash']}, this job's "
                                 f"is {self.spec.config_hash}); use another checkpoint.path for this job")
            if saved["version"] != cut.version or saved.get("lineage", "") != cut.lineage:
                raise UnreadableCheckpoint(f"{name} holds version {saved['version']} of lineage "
                                           f"{saved.get('lineage', '')!r}, not what its name says")
            self.version, self.tickets = saved["version"], list(saved["tickets"])
            entries |= saved["params"]
            merged_state |= saved["optimizer"]["state"]
            prediction = saved.get("prediction", {})
            previous |= prediction.get("previous", {})
            expected_staleness = prediction.get("expected_staleness", expected_staleness)
            groups = saved["optimizer"]["param_groups"]
        # The optimizer numbers parameters in its param groups' order, the same on every server.
        numbered = [p for group in self.optimizer.param_groups for p in group["params"]]
        owned = {id(p) for p in self.params.values()}
        owned_ids = {i for i, p in enumerate(numbered) if id(p) in owned}
        served = self._served()
        if wrong := [n for n, t in served.items() if n not in entries or entries[n].shape != t.shape]:
            raise UnreadableCheckpoint(f"{cut.directory} does not hold {wrong[0]!r} as this model has it (shape "
                                       f"{tuple(served[wrong[0]].shape)})")
        with torch.no_grad():
            for name, tensor in served.items():
                tensor.copy_(entries[name])
        self.optimizer.load_state_dict({"state": {i: s for i, s in merged_state.items() if i in owned_ids},
                                        "param_groups": groups})
        if self.predictor:
            self.predictor.load_state_dict({"previous": previous, "expected_staleness": expected_staleness})


ParameterServerActor = ray.remote(ParameterServer)
