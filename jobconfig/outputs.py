"""What a run leaves behind besides result.json and model.pt: checkpoints and experiment tracking."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from raylastic.jobconfig.checks import is_non_negative_int, is_number, is_positive_int, one_of, require

Resume = Literal["auto", "never"]
MAX_EVERY_MINUTES = 10_080.0
"""Upper bound of ``checkpoint.every_minutes`` (a week): a longer one is a unit mix-up."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    path: str | None = None
    """Directory or fsspec URL for checkpoints; None: <run dir>/checkpoints."""
    every_steps: int = 0
    """Save every this many steps (0: only at the end of the run)."""
    every_minutes: float = 10.0
    """Also save (in the background) once this many minutes have passed since the last checkpoint, at a step
    all ranks agree on (0: off). What a sharded run loses with a worker and its buddy together."""
    num_to_keep: int = 2
    """Complete checkpoints kept; older ones are removed after a newer one is complete."""
    resume: Resume = "auto"
    """"auto": continue from the newest complete checkpoint of this run if there is one."""
    async_save: bool = False
    """Write checkpoints in the background while the next steps train (a side process group)."""

    def __post_init__(self) -> None:
        require(self.path is None or (isinstance(self.path, str) and bool(self.path)), "checkpoint.path",
                "a directory path or null", self.path)
        require(is_non_negative_int(self.every_steps), "checkpoint.every_steps", "a non-negative integer",
                self.every_steps)
        require(is_number(self.every_minutes) and 0 <= self.every_minutes <= MAX_EVERY_MINUTES,
                "checkpoint.every_minutes", f"a number of minutes in [0, {MAX_EVERY_MINUTES:g}] (0: off)",
                self.every_minutes)
        require(is_positive_int(self.num_to_keep), "checkpoint.num_to_keep", "a positive integer", self.num_to_keep)
        require(self.resume in get_args(Resume), "checkpoint.resume", one_of(get_args(Resume)), self.resume)
        require(isinstance(self.async_save, bool), "checkpoint.async_save", "true or false", self.async_save)


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    mlflow_uri: str | None = None
    """MLflow tracking URI (a local directory such as ``mlruns``, ``file:///...`` or ``http://host:5000``);
    None: no MLflow logging. Needs ``pip install 'raylastic[mlflow]'``."""
    mlflow_experiment: str = "raylastic"
    """The MLflow experiment the run is logged under (created if missing)."""

    def __post_init__(self) -> None:
        require(self.mlflow_uri is None or (isinstance(self.mlflow_uri, str) and bool(self.mlflow_uri)),
                "tracking.mlflow_uri", "a tracking URI or null", self.mlflow_uri)
        require(isinstance(self.mlflow_experiment, str) and bool(self.mlflow_experiment),
                "tracking.mlflow_experiment", "a non-empty string", self.mlflow_experiment)
