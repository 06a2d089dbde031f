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
to ``<checkpoint root>/ps_<version>/server_<index>_of_<count>.pt``; all servers of a run write at the
same versions, so one directory with every server's file is a consistent cut of the whole state, loadable
at any server count (``restore``)::

    server = ParameterServer(spec, index=0, names=["w", "b"])
    epoch, version, params = server.pull()
    server.push(epoch, update=1, read_version=0, gradients={"w": ..., "b": ...}, buffers={}, ticket=0)
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any

import fsspec
import ray
import torch

from actors.async_ps.prediction import WeightPredictor
from actors.recipe import learning_rate, optimizer_factory, set_learning_rate
from jobconfig import FaultConfig, OptimConfig, TrainingConfig, WorkloadConfig
from workloads import load_workload

CHECKPOINT_PREFIX = "ps_"


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


class StalenessViolation(RuntimeError):
    """A gradient older than max_staleness reached a server: a defect of the admission, never applied."""


def checkpoint_dir(root: str, version: int) -> str:
    return f"{root.rstrip('/')}/{CHECKPOINT_PREFIX}{version:08d}"


def server_file(directory: str, index: int, num_servers: int) -> str:
    return f"{directory}/server_{index}_of_{num_servers}.pt"


class ParameterServer:
    def __init__(self, spec: ServerSpec, *, index: int, names: list[str]) -> None:
        torch.set_num_threads(spec.torch_threads)
        self.spec, self.index, self.names = spec, index, list(names)
        self.workload = load_workload(spec.workload.name, spec.workload.options)
        self.build_optimizer = optimizer_factory(spec.optim, getattr(self.workload, "configure_optimizer", None))
        self.epoch = 0
        self.max_applied_staleness = 0
        self._reset()

    # -- what workers call ---------------------------------------------------------------------------------
    def pull(self) -> tuple[int, int, dict[str, torch.Tensor]]:
        """(epoch, version, this server's parameters - predicted where ``predict_weights`` - and buffers, on
        server 0)."""
        params = self.predictor.served(self.version) if self.predictor else self.params
        return self.epoch, self.version, self._served(params)

    def push(self, epoch: int, update: int, read_version: int, gradients: dict[str, torch.Tensor],
             buffers: dict[str, torch.Tensor], ticket: int) -> bool:
        """Take admitted update ``update`` (computed on this server's version ``read_version``); False when it
        belongs to an epoch before a restore (the worker fetches the servers again)."""
        if epoch != self.epoch:
            return False
        self.pending[update] = (read_version, gradients, buffers, ticket)
        self._apply_ready()
        return True

    # -- what the Controller calls -------------------------------------------------------------------------
    def skip(self, epoch: int, update: int) -> bool:
        """Update ``update``'s worker died: True if its gradient arrived here anyway, else it is skipped."""
        if epoch != self.epoch:
            return False
        if update <= self.version or update in self.pending:
            return True
        self.skipped.add(update)
        self._apply_ready()
        return False

    def restore(self, epoch: int, directory: str | None) -> int:
        """Start epoch ``epoch`` from checkpoint ``directory`` (None: the run's initial state); returns the version."""
        self.epoch = epoch
        self._reset()
        if directory is not None:
            self._load(directory)
        return self.version

    def version_now(self) -> int:
        return self.version

    def tickets_applied(self) -> list[int]:
        """The ticket of every update applied so far, in update order (-1: skipped)."""
        return list(self.tickets)

    def stats(self) -> dict[str, int]:
        return {"version": self.version, "epoch": self.epoch, "max_applied_staleness": self.max_applied_staleness,
                "skipped_updates": self.skipped_count}

    def save(self) -> str:
        """Write this server's share now (the end of the run); returns the checkpoint directory."""
        return self._save()

    def state(self) -> dict[str, torch.Tensor]:
        """This server's share of the final model (parameters; buffers on server 0)."""
        return {name: tensor.detach().clone() for name, tensor in self._served().items()}

    # -- inside ---------------------------------------------------------------------------------------------
    def _reset(self) -> None:
        torch.manual_seed(self.spec.training.seed)  # the same initial parameters on every server
        self.model = self.workload.build_model()
        self.optimizer = self.build_optimizer(self.model)
        self.params = {name: p for name, p in self.model.named_parameters() if name in set(self.names)}
        self.predictor = WeightPredictor(self.params) if self.spec.predict_weights else None
        self.version = 0
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
            self._save()

    def _save(self) -> str:
        directory = checkpoint_dir(self.spec.checkpoint_root, self.version)
        fs, path = fsspec.core.url_to_fs(server_file(directory, self.index, self.spec.num_servers))
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        payload = {"config_hash": self.spec.config_hash, "version": self.version, "tickets": list(self.tickets),
                   "params": {n: p.detach() for n, p in self._served().items()},
                   "optimizer": self.optimizer.state_dict(),
                   "prediction": self.predictor.state_dict() if self.predictor else {}}
        with fs.open(f"{path}.tmp", "wb") as handle:
            torch.save(payload, handle)
        fs.mv(f"{path}.tmp", path)  # a reader sees the whole file or none
        return directory

    def _load(self, directory: str) -> None:
        fs, path = fsspec.core.url_to_fs(directory)
        merged_state: dict[int, Any] = {}
        groups = None
        entries: dict[str, torch.Tensor] = {}
        previous: dict[str, torch.Tensor] = {}
        expected_staleness = 0.0
        for name in sorted(fs.ls(path, detail=False)):
            if not name.endswith(".pt"):
                continue
            with fs.open(name, "rb") as handle:
                saved = torch.load(handle, weights_only=True)
            if saved["config_hash"] != self.spec.config_hash:
                raise ValueError(f"{name} was saved by another job (config hash {saved['config_hash']}, this job's "
                                 f"is {self.spec.config_hash})")
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
        with torch.no_grad():
            for name, tensor in self._served().items():
                tensor.copy_(entries[name])
        self.optimizer.load_state_dict({"state": {i: s for i, s in merged_state.items() if i in owned_ids},
                                        "param_groups": groups})
        if self.predictor:
            self.predictor.load_state_dict({"previous": previous, "expected_staleness": expected_staleness})


ParameterServerActor = ray.remote(ParameterServer)
