"""Where the workers run and what they survive: scaling, failure handling and injected faults."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

from raylastic.jobconfig.checks import is_non_negative_int, is_number, is_positive_int, one_of, require, require_seconds

FaultAction = Literal["kill", "ray_kill", "stall", "raise", "remove_node", "throttle", "kill_server"]
FAULT_ACTIONS: tuple[str, ...] = get_args(FaultAction)
ENV_VAR_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
RESERVED_WORKER_ENV = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                       "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "RAYLASTIC_PROCESS_ROLE")
"""Variables raylastic sets in its workers itself (strategies/nccl_recovery.py NCCL_RECOVERY_ENVIRONMENT,
actors/processes/setup_hook.py worker_runtime_env): a worker's recovery and device binding depend on them."""


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    min_workers: int = 2
    """The run starts once this many workers are placed."""
    max_workers: int = 2
    """The run never uses more workers than this."""
    use_gpu: bool = False
    """One GPU per worker, NCCL between them; otherwise CPU workers on gloo."""
    cpus_per_worker: float = 1.0
    """Ray CPUs reserved per worker (fractions allowed); torch uses max(1, floor) threads."""
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    """Further Ray resources each worker reserves, e.g. {"worker_slot": 1} or {"accelerator_type:A100": 0.01}.
    Not CPU or GPU: those are cpus_per_worker and use_gpu (Ray takes them apart from custom resources)."""
    spare_workers: int = 0
    """Workers kept started and idle (workload, data and model built), each in a slot of its own: a failure or a
    scale-up takes one at the next step boundary instead of starting a process, and a new spare starts
    behind it."""
    warm_processes: bool = True
    """After workers start on a node, start one more process there for the run, kept idle (up to an hour) with
    torch and the worker's modules imported: a replacement or a joiner placed there then skips ~2 s of its
    start. Costs an idle process (~330 MB) per node."""
    balance: Literal["off", "auto"] = "auto"
    """auto: each rank's share of the global batch follows its measured speed (same gradient; see
    actors/data/balance.py), changed only when that predicts a step at least 10% shorter, so equal ranks keep
    equal shares; off: equal shares always."""
    straggler_factor: float = 4.0
    """A rank's share never drops below the even share over this factor; a rank held there whose compute still
    takes longer than the others', persistently, is reported (event ``straggler``) and drained when
    min_workers allows. > 1."""
    worker_env: dict[str, str] = field(default_factory=dict)
    """Environment variables set in every worker's process (its Ray runtime environment), e.g. NCCL's
    {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5", "NCCL_DEBUG": "INFO"}. Names [A-Z_][A-Z0-9_]*, values
    strings; not the variables raylastic sets itself (RESERVED_WORKER_ENV)."""
    placement_timeout_s: float = 120.0
    """How long to wait for min_workers to be placed, at the start and after failures, before failing; in
    [10 s, a day]. Waiting after a failure includes starting the replacement (a process importing torch
    and building the model: seconds), so a shorter wait would fail recoveries that had the resources."""

    def __post_init__(self) -> None:
        require(is_positive_int(self.min_workers), "scaling.min_workers", "a positive integer", self.min_workers)
        require(is_positive_int(self.max_workers), "scaling.max_workers", "a positive integer", self.max_workers)
        if self.min_workers > self.max_workers:
            raise ValueError(f"scaling.min_workers ({self.min_workers}) must be <= scaling.max_workers "
                             f"({self.max_workers})")
        require(isinstance(self.use_gpu, bool), "scaling.use_gpu", "true or false", self.use_gpu)
        require(is_number(self.cpus_per_worker) and self.cpus_per_worker > 0, "scaling.cpus_per_worker",
                "a positive number", self.cpus_per_worker)
        require(isinstance(self.resources_per_worker, dict) and all(
            isinstance(k, str) and is_number(v) and v > 0 for k, v in self.resources_per_worker.items()),
            "scaling.resources_per_worker", "a mapping of resource name to a positive amount",
            self.resources_per_worker)
        for name, instead in (("CPU", "scaling.cpus_per_worker"), ("GPU", "scaling.use_gpu")):
            if name in self.resources_per_worker:
                raise ValueError(f"scaling.resources_per_worker cannot reserve {name}: use {instead} instead, got "
                                 f"{self.resources_per_worker!r}")
        require(is_non_negative_int(self.spare_workers), "scaling.spare_workers", "an integer >= 0",
                self.spare_workers)
        require(isinstance(self.warm_processes, bool), "scaling.warm_processes", "true or false",
                self.warm_processes)
        if isinstance(self.balance, bool):  # YAML reads a bare off as false
            object.__setattr__(self, "balance", "auto" if self.balance else "off")
        require(self.balance in ("off", "auto"), "scaling.balance", one_of(("off", "auto")), self.balance)
        require(is_number(self.straggler_factor) and self.straggler_factor > 1, "scaling.straggler_factor",
                "a number > 1", self.straggler_factor)
        require_seconds(self.placement_timeout_s, "scaling.placement_timeout_s", low=10)
        require(isinstance(self.worker_env, dict) and all(
            isinstance(k, str) and ENV_VAR_NAME.fullmatch(k) and isinstance(v, str)
            for k, v in self.worker_env.items()),
            "scaling.worker_env", "a mapping of variable name ([A-Z_][A-Z0-9_]*) to a string value", self.worker_env)
        reserved = sorted(set(self.worker_env) & set(RESERVED_WORKER_ENV))
        if reserved:
            raise ValueError(f"scaling.worker_env cannot set {', '.join(reserved)}: raylastic sets them in every "
                             f"worker for its NCCL recovery and device binding (docs/cluster.md)")


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    max_failures: int = 3
    """Failures the run survives; one more ends it with an error (0: fail on the first). Workers lost
    together (a node with several, heard within one generation) count as one failure."""
    collective_timeout_s: float = 30.0
    """Timeout of collective operations, so a silent peer cannot block a group for long; in [1 s, a day].
    Forming a group and its first collectives take a few tenths of a second on an idle machine: below a
    second a busy one would time out healthy groups."""
    step_timeout_s: float = 10.0
    """A worker that does not answer the Controller for this long is taken as hung and replaced; in [1 s, a
    day]. Polls go out every min(1 s, step_timeout_s / 4): below a second, Ray's latency on a busy machine
    would make healthy workers look hung."""
    max_step_s: float = 600.0
    """A worker whose step runs this long is taken as hung and replaced (a rank that lags its peers is
    caught sooner, when their collectives time out); raise it for steps that legitimately take longer. It
    bounds the work at a step boundary (a periodic save) and the Controller's calls (the final save, gather
    and evaluation) too. In [1 s, a day], as the other timeouts."""
    max_start_failures: int = 3
    """New workers in a row (joiners, replacements, spares) that may fail to start - their workload or CUDA
    cannot be built where they were placed - before the run fails with the error; each is replaced on a new
    slot until then."""

    def __post_init__(self) -> None:
        require(is_non_negative_int(self.max_failures), "failure.max_failures", "a non-negative integer",
                self.max_failures)
        require_seconds(self.collective_timeout_s, "failure.collective_timeout_s", low=1)
        require_seconds(self.step_timeout_s, "failure.step_timeout_s", low=1)
        require_seconds(self.max_step_s, "failure.max_step_s", low=1)
        require(is_positive_int(self.max_start_failures), "failure.max_start_failures", "a positive integer",
                self.max_start_failures)


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """A fault to inject, for tests and demos: ``{action: kill, rank: 1, step: 30}``, or a slow rank:
    ``{action: throttle, rank: 2, step: 1, factor: 2.0, until_step: 300}``."""

    ALLOWED: ClassVar[dict[str, str]] = {"action": one_of(FAULT_ACTIONS), "rank": "a non-negative integer",
                                         "step": "a positive integer"}
    """What each field takes, for the error that names a wrong or missing one."""
    action: FaultAction
    """kill: the worker SIGKILLs itself; ray_kill: it is ray.kill()ed from outside (by a task it starts);
    stall: it SIGSTOPs itself (a hung worker); raise: its step raises; remove_node: its node's raylet is killed (the
    whole node leaves; refused on the head node); kill_server (strategy.name=async_ps): parameter server ``rank``
    SIGKILLs itself as it applies update ``step``."""
    rank: int
    """The rank, in the generation running at that step, that the fault hits."""
    step: int
    """The fault hits while this step (1-based) is in flight; it fires once per run. A throttle starts there."""
    factor: float = 1.0
    """throttle only: the rank's steps take this many times their compute time (> 1), as a slower GPU's would."""
    until_step: int | None = None
    """throttle only: the last step it slows (None: to the end of the run)."""
    microbatch: int | None = None
    """kill, stall, raise under parallel.pp > 1: the fault fires inside the step, as the rank's stage is about to
    run this micro-batch's forward (0-based; the pipeline's other ranks are then mid-schedule); None: before the
    step."""

    def __post_init__(self) -> None:
        require(self.action in FAULT_ACTIONS, "faults[].action", self.ALLOWED["action"], self.action)
        require(is_non_negative_int(self.rank), "faults[].rank", self.ALLOWED["rank"], self.rank)
        require(is_positive_int(self.step), "faults[].step", self.ALLOWED["step"], self.step)
        require(self.microbatch is None or (is_non_negative_int(self.microbatch)
                                            and self.action in ("kill", "stall", "raise")),
                "faults[].microbatch", "null, or a non-negative integer with action kill, stall or raise",
                self.microbatch)
        if self.action != "throttle":
            if self.factor != 1.0 or self.until_step is not None:
                raise ValueError(f"faults[].factor and faults[].until_step are for action throttle only, got "
                                 f"action {self.action!r} with factor {self.factor!r}, until_step {self.until_step!r}")
            return
        require(is_number(self.factor) and self.factor > 1, "faults[].factor", "a number > 1 for a throttle",
                self.factor)
        require(self.until_step is None or (is_positive_int(self.until_step) and self.until_step >= self.step),
                "faults[].until_step", f"None or a step >= faults[].step ({self.step})", self.until_step)

    def active_at(self, step: int) -> bool:
        """A throttle: whether it slows step ``step`` (1-based)."""
        return self.step <= step and (self.until_step is None or step <= self.until_step)
