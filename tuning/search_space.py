"""A validated search space over a job's configuration: dotted keys, each with a distribution.

Keys are the job's own dotted config keys (``optim.lr``, ``training.global_batch_size``,
``strategy.bucket_cap_mb``). A space is checked against the base job before any trial starts:
an unknown key, an empty range or a value the job itself would refuse raises ValueError naming
the key and what is allowed. Pure: no Ray here.

Example (the YAML of ``raylastic sweep --space``, or the same mapping in Python)::

    optim.lr: {loguniform: [1.0e-4, 1.0e-1]}
    training.global_batch_size: {choice: [32, 64, 128]}
    strategy.bucket_cap_mb: {choice: [1, 5, 25]}

    space = SearchSpace.from_dict(yaml.safe_load(text))
    space.validate(base_job)                       # ValueError naming the key on a bad range
    job = space.apply(base_job, {"optim.lr": 3e-3})
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from raylastic.jobconfig import JobConfig, job_config_from_dict

NOT_TUNABLE = {
    "name": "it names the sweep's jobs",
    "faults": "faults are injected through the base job",
    "link": "an emulated link is set in the base job, as faults are: it changes time, not the math",
    "workload.name": "a sweep tunes one workload",
    "workload.options": "a mapping, not a value",
    "checkpoint.path": "every trial keeps its checkpoints in its own directory",
    "checkpoint.resume": "trials resume from their own checkpoints",
    "training.record_samples": "it records, it does not tune",
    "scaling": "each trial's placement group is sized from the base job's scaling section",
}
"""Config keys (or whole sections) a sweep cannot vary, and why."""


@dataclass(frozen=True)
class LogUniform:
    """A float drawn uniformly in log space from [low, high]; ``{loguniform: [1e-4, 1e-1]}``."""

    low: float
    high: float


@dataclass(frozen=True)
class Uniform:
    """A float drawn uniformly from [low, high]; ``{uniform: [0.0, 0.1]}``."""

    low: float
    high: float


@dataclass(frozen=True)
class IntRange:
    """An integer drawn uniformly from [low, high], both included; ``{int: [20, 60]}``."""

    low: int
    high: int


@dataclass(frozen=True)
class Choice:
    """One of the listed values; ``{choice: [32, 64, 128]}``."""

    values: tuple[Any, ...]


MAX_COMBINATIONS_CHECKED = 4096
Distribution = LogUniform | Uniform | IntRange | Choice
DISTRIBUTIONS = {"loguniform": LogUniform, "uniform": Uniform, "int": IntRange, "choice": Choice}


def tunable_keys() -> dict[str, Any]:
    """Every dotted key a sweep may vary, with its type hint, derived from the JobConfig dataclasses."""
    keys: dict[str, Any] = {}
    for section in dataclasses.fields(JobConfig):
        hint = typing.get_type_hints(JobConfig)[section.name]
        if not dataclasses.is_dataclass(hint) or section.name in NOT_TUNABLE:
            continue
        hints = typing.get_type_hints(hint)
        for leaf in dataclasses.fields(hint):
            key = f"{section.name}.{leaf.name}"
            if key not in NOT_TUNABLE:
                keys[key] = hints[leaf.name]
    return keys


@dataclass(frozen=True)
class SearchSpace:
    """Dotted job-config keys, each with the distribution a sweep samples it from."""

    parameters: dict[str, Distribution]

    def __post_init__(self) -> None:
        if not self.parameters:
            raise ValueError("search space is empty: give at least one key, e.g. "
                             "{'optim.lr': {'loguniform': [1e-4, 1e-1]}}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SearchSpace:
        """Parse ``{key: {distribution: arguments}}``; keys may be dotted or nested in sections."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"search space must be a mapping of config keys to distributions, got {raw!r}")
        return cls({key: _parse_distribution(key, spec) for key, spec in _flatten(raw).items()})

    @classmethod
    def from_yaml(cls, path: str | Path) -> SearchSpace:
        """Read a search space from a YAML file (see the module docstring for the format)."""
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except OSError as error:
            raise ValueError(f"--space {path}: cannot read it ({error.strerror})") from error
        except yaml.YAMLError as error:
            raise ValueError(f"--space {path}: not valid YAML ({error})") from error
        return cls.from_dict(raw or {})

    def to_dict(self) -> dict[str, dict[str, list[Any]]]:
        """The YAML/JSON form, the inverse of ``from_dict``."""
        names = {cls: name for name, cls in DISTRIBUTIONS.items()}
        return {key: {names[type(d)]: list(d.values) if isinstance(d, Choice) else [d.low, d.high]}
                for key, d in self.parameters.items()}

    def validate(self, base: JobConfig) -> None:
        """Raise ValueError naming the key if a key is unknown, a range is empty, or the job refuses a bound."""
        allowed = tunable_keys()
        for key, distribution in self.parameters.items():
            if key not in allowed:
                raise ValueError(f"search space: {_why_not(key)}; tunable keys: {', '.join(allowed)}")
            _check_shape(key, distribution, allowed[key])
            for value in _extremes(distribution):
                try:
                    self.apply(base, {key: value})
                except ValueError as error:
                    raise ValueError(f"search space {key}: the value {value!r} is not allowed: {error}") from None
        self._validate_combinations(base)

    def _validate_combinations(self, base: JobConfig) -> None:
        """Values fine alone may not go together (strategy.compression needs strategy.name ddp): try
        every combination of the choices and range bounds, unless there are too many."""
        extremes = [_extremes(d) for d in self.parameters.values()]
        if len(self.parameters) < 2 or math.prod(len(e) for e in extremes) > MAX_COMBINATIONS_CHECKED:
            return
        for values in itertools.product(*extremes):
            point = dict(zip(self.parameters, values, strict=True))
            try:
                self.apply(base, point)
            except ValueError as error:
                shown = ", ".join(f"{k}={v!r}" for k, v in point.items())
                raise ValueError(f"search space: {shown} is not a valid job: {error}; sweep such keys "
                                 "separately") from None

    def complete_point(self, base: JobConfig, point: Mapping[str, Any]) -> dict[str, Any]:
        """``point`` (values to try first) with every key of the space: missing ones from ``base``.

        Raises ValueError naming the key when a key is not in the space or a value is outside its
        distribution.
        """
        unknown = sorted(set(point) - set(self.parameters))
        if unknown:
            raise ValueError(f"points_to_evaluate: {unknown[0]} is not in the search space "
                             f"({', '.join(self.parameters)})")
        raw = base.to_dict()
        complete = {}
        for key, distribution in self.parameters.items():
            section, leaf = key.split(".", 1)
            value = point[key] if key in point else raw[section][leaf]
            inside = (value in distribution.values if isinstance(distribution, Choice)
                      else distribution.low <= value <= distribution.high)
            if not inside:
                source = "" if key in point else " (the base job's value; give one in the point)"
                raise ValueError(f"points_to_evaluate: {key}={value!r}{source} is outside its distribution "
                                 f"{distribution}")
            complete[key] = next(v for v in distribution.values if v == value) if isinstance(
                distribution, Choice) else value  # 25.0 from the job is the choice 25
        self.apply(base, complete)
        return complete

    def apply(self, base: JobConfig, values: Mapping[str, Any]) -> JobConfig:
        """``base`` with each dotted key set to its value (a trial's job), validated like any job."""
        raw = base.to_dict()
        for key, value in values.items():
            section, leaf = key.split(".", 1)
            raw[section][leaf] = value
        return job_config_from_dict(raw)


DEFAULT_SEARCH_SPACE = SearchSpace({
    "optim.lr": LogUniform(1e-4, 1e-1),
    "training.global_batch_size": Choice((32, 64, 128)),
    "strategy.bucket_cap_mb": Choice((1, 5, 25)),
})
"""Learning rate (log-uniform), global batch size and DDP bucket size."""


def _flatten(raw: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        is_section = isinstance(value, Mapping) and not (set(value) & set(DISTRIBUTIONS)) and "." not in dotted
        if is_section and value:
            flat.update(_flatten(value, prefix=f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def _parse_distribution(key: str, spec: Any) -> Distribution:
    usage = "{loguniform: [low, high]}, {uniform: [low, high]}, {int: [low, high]} or {choice: [v1, v2, ...]}"
    if not (isinstance(spec, Mapping) and len(spec) == 1 and next(iter(spec)) in DISTRIBUTIONS):
        raise ValueError(f"search space {key}: expected one of {usage}, got {spec!r}")
    kind, arguments = next(iter(spec.items()))
    if kind == "choice":
        if not isinstance(arguments, (list, tuple)) or not arguments:
            raise ValueError(f"search space {key}: choice needs a non-empty list of values, got {arguments!r}")
        if not all(isinstance(v, (bool, int, float, str)) for v in arguments):
            raise ValueError(f"search space {key}: choice values must be numbers, strings or booleans, "
                             f"got {arguments!r}")
        return Choice(tuple(arguments))
    if isinstance(arguments, Mapping) and set(arguments) == {"low", "high"}:
        arguments = [arguments["low"], arguments["high"]]
    if not isinstance(arguments, (list, tuple)) or len(arguments) != 2:
        raise ValueError(f"search space {key}: {kind} needs [low, high], got {arguments!r}")
    low, high = (_number(key, kind, v) for v in arguments)
    if kind == "int" and not all(float(v).is_integer() for v in (low, high)):
        raise ValueError(f"search space {key}: int needs whole-number bounds, got [{low}, {high}]")
    if low >= high:
        raise ValueError(f"search space {key}: empty range: low ({low}) must be below high ({high})")
    if kind == "loguniform" and low <= 0:
        raise ValueError(f"search space {key}: loguniform needs 0 < low < high, got low {low}")
    if kind == "int":
        return IntRange(int(low), int(high))
    return DISTRIBUTIONS[kind](float(low), float(high))


def _number(key: str, kind: str, value: Any) -> float:
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"search space {key}: {kind} bounds must be finite numbers, got {value!r}")
    return value


def _why_not(key: str) -> str:
    for prefix, reason in NOT_TUNABLE.items():
        if key == prefix or key.startswith(f"{prefix}."):
            return f"{key} cannot be swept ({reason})"
    return f"unknown key {key}"


def _check_shape(key: str, distribution: Distribution, hint: Any) -> None:
    takes_int = hint is int or (int in typing.get_args(hint) and float not in typing.get_args(hint))
    if takes_int and isinstance(distribution, (LogUniform, Uniform)):
        raise ValueError(f"search space {key}: takes integers; use {{int: [low, high]}} or {{choice: [...]}}")


def _extremes(distribution: Distribution) -> tuple[Any, ...]:
    if isinstance(distribution, Choice):
        return distribution.values
    return distribution.low, distribution.high
