"""A sweep's results: one DataFrame row per trial, the best config as a JobConfig, and plots.

Plots use matplotlib's object API (no pyplot, no GUI backend), so they render the same
headless, in CI and in a notebook, where ``SweepResult`` shows its table and plots inline.

Example::

    result = sweep(job, space, num_samples=8, metric="accuracy", mode="max")
    result.dataframe.sort_values("accuracy", ascending=False).head()
    cluster.train(result.best_config)
    result.plots("runs/sweeps/plots")    # [Path(".../accuracy_vs_optim.lr.png"), ...]
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from matplotlib.figure import Figure

from raylastic.jobconfig import JobConfig
from raylastic.tuning.search_space import Choice, Distribution, IntRange, LogUniform, SearchSpace
from raylastic.tuning.trial import FINAL_STEP, JOBS_DIR

Status = Literal["completed", "early_stopped", "error", "unfinished"]


@dataclass(frozen=True, kw_only=True, repr=False)
class SweepResult:
    """What ``sweep`` returns: the trials table, the best config, plots; a notebook shows it inline.

    Example::

        result.completed.nlargest(3, "accuracy")    # the three best finished trials
        result.best_config.optim.lr                  # the best trial's learning rate
    """

    dataframe: pd.DataFrame
    """One row per trial, in the order trials started: ``trial``, ``trial_id``, each swept key, the
    objective, ``loss``, ``steps``, ``time_s``, ``failures`` (worker failures the trial's job survived),
    ``status`` (completed, early_stopped, error, unfinished) and ``run_dir`` (the trial's job: result.json,
    model.pt, checkpoints)."""
    base_job: JobConfig
    space: SearchSpace
    metric: str
    mode: Literal["min", "max"]
    path: Path
    """The sweep's directory: Tune's state, ``trial_<id>/`` (Tune's results), ``jobs/<id>/`` (the jobs')."""
    num_samples: int
    """Trials the sweep was started with (fewer rows, or unfinished ones: it was interrupted)."""

    @classmethod
    def from_result_grid(cls, grid: Any, *, space: SearchSpace, base_job: JobConfig, metric: str,
                         mode: Literal["min", "max"], path: Path, num_samples: int) -> SweepResult:
        rows = [_row(result, space, metric, jobs_dir=path / JOBS_DIR) for result in grid]
        columns = dict.fromkeys(["trial", "trial_id", *space.parameters, metric, "loss", "steps", "time_s",
                                  "failures", "status", "run_dir"])  # metric may be "loss" itself
        frame = pd.DataFrame(rows, columns=list(columns))
        for key, distribution in space.parameters.items():
            if _all_ints(distribution):  # keep batch sizes integers next to trials without a value
                frame[key] = frame[key].astype("Int64")
        frame = frame.sort_values(["trial", "trial_id"]).reset_index(drop=True)
        frame["trial"] = range(len(frame))
        return cls(dataframe=frame, base_job=base_job, space=space, metric=metric, mode=mode, path=path,
                   num_samples=num_samples)

    @property
    def completed(self) -> pd.DataFrame:
        """The trials that ran to their last step and reported the objective."""
        frame = self.dataframe
        return frame[(frame["status"] == "completed") & frame[self.metric].notna()]

    @property
    def interrupted(self) -> bool:
        """True when trials are missing or unfinished: resume the sweep with the same name."""
        return len(self.dataframe) < self.num_samples or bool((self.dataframe["status"] == "unfinished").any())

    @property
    def best(self) -> pd.Series:
        """The best completed trial's row."""
        completed = self.completed
        if completed.empty:
            raise ValueError(f"no trial of sweep {self.path.name!r} completed with a {self.metric!r} value; "
                             f"statuses: {self.dataframe['status'].value_counts().to_dict()}")
        position = completed[self.metric].idxmax() if self.mode == "max" else completed[self.metric].idxmin()
        return completed.loc[position]

    @property
    def best_config(self) -> JobConfig:
        """The base job with the best trial's values, named ``<sweep>-best``: ready for ``cluster.train``."""
        best = self.best
        values = {key: _plain(best[key], self.space.parameters[key]) for key in self.space.parameters}
        return dataclasses.replace(self.space.apply(self.base_job, values), name=f"{self.path.name}-best")

    def plots(self, directory: str | Path) -> list[Path]:
        """Write the objective against each swept key and the optimization history as PNGs."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, figure in self.figures().items():
            path = directory / f"{name}.png"
            figure.savefig(path, dpi=110, bbox_inches="tight")
            paths.append(path)
        return paths

    def figures(self) -> dict[str, Figure]:
        """The figures ``plots`` writes, by file name (without .png)."""
        figures = {f"{self.metric}_vs_{key}": self._vs_key_figure(key) for key in self.space.parameters}
        figures["optimization_history"] = self._history_figure()
        return figures

    def summary(self) -> str:
        """One line: trials by status, the best trial and its values, and whether to resume."""
        frame = self.dataframe
        counts = ", ".join(f"{count} {status}" for status, count in frame["status"].value_counts().items())
        line = f"sweep {self.path.name}: {len(frame)} trials ({counts})"
        if not self.completed.empty:
            best = self.best
            values = ", ".join(f"{key}={_format(best[key])}" for key in self.space.parameters)
            line += f"; best {self.metric} {best[self.metric]:.4f} (trial {best['trial']}: {values})"
        if self.interrupted:
            line += "; interrupted: resume it with the same name and resume=True (--resume)"
        return line

    def __repr__(self) -> str:
        return f"SweepResult({self.summary()})"

    def _repr_html_(self) -> str:
        images = "".join(f'<img src="data:image/png;base64,{_png_base64(f)}" style="max-width:32%;">'
                         for f in self.figures().values())
        table = self.dataframe.drop(columns="run_dir").to_html()
        return f"<p>{html.escape(self.summary())}</p>{table}<div>{images}</div>"

    def _vs_key_figure(self, key: str) -> Figure:
        figure = Figure(figsize=(4.5, 3.4))
        axes = figure.subplots()
        completed = self.completed
        axes.scatter([_numeric(v) for v in completed[key]], completed[self.metric], color="tab:blue",
                     label="completed")
        self._rug(axes, [_numeric(v) for v in self.dataframe.loc[self._stopped(), key].dropna()])
        _scale_x(axes, self.space.parameters[key])
        axes.set(xlabel=key, ylabel=self.metric, title=f"{self.metric} vs {key}")
        axes.legend(fontsize="small")
        return figure

    def _history_figure(self) -> Figure:
        figure = Figure(figsize=(4.5, 3.4))
        axes = figure.subplots()
        completed = self.completed
        axes.scatter(completed["trial"], completed[self.metric], color="tab:blue", label="trial")
        best = completed[self.metric].cummax() if self.mode == "max" else completed[self.metric].cummin()
        axes.step(completed["trial"], best, where="post", color="tab:orange", label="best so far")
        self._rug(axes, list(self.dataframe.loc[self._stopped(), "trial"]))
        axes.set(xlabel="trial", ylabel=self.metric, title="optimization history")
        axes.legend(fontsize="small")
        return figure

    def _stopped(self) -> pd.Series:
        return self.dataframe["status"] != "completed"

    @staticmethod
    def _rug(axes: Any, xs: list[float]) -> None:
        """Trials without the objective (stopped early, failed) as ticks along the x axis."""
        if xs:
            axes.plot(xs, [0.0] * len(xs), "|", color="tab:red", markersize=14, markeredgewidth=2,
                      transform=axes.get_xaxis_transform(), label="stopped early / failed")


def _row(result: Any, space: SearchSpace, metric: str, *, jobs_dir: Path) -> dict[str, Any]:
    metrics = result.metrics or {}
    trial_id = Path(result.path).name.removeprefix("trial_")
    status: Status
    if result.error is not None:
        status = "error"
    elif metrics.get("completed"):
        status = "completed"
    elif metrics.get("done"):
        status = "early_stopped"
    else:
        status = "unfinished"
    value = metrics.get(metric) if status == "completed" else None
    # The trial's start: Tune stamps every result with its wall-clock time and the trial's age.
    started = metrics["timestamp"] - metrics["time_total_s"] if "time_total_s" in metrics else math.inf
    return {"trial": started, "trial_id": trial_id,
            **{key: (result.config or {}).get(key) for key in space.parameters},
            metric: math.nan if value is None else value, "loss": metrics.get("loss", math.nan),
            "steps": metrics.get(FINAL_STEP, metrics.get("step", 0)), "time_s": metrics.get("time_total_s", math.nan),
            "failures": metrics.get("failures", 0), "status": status, "run_dir": str(jobs_dir / trial_id)}


def _scale_x(axes: Any, distribution: Distribution) -> None:
    """Log x for log-uniform keys and for numeric choices spanning a decade or more (1, 5, 25 MiB)."""
    if isinstance(distribution, LogUniform):
        axes.set_xscale("log")
    elif isinstance(distribution, Choice) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in distribution.values):
        values = sorted(distribution.values)
        if values[0] > 0 and values[-1] / values[0] >= 10:
            axes.set_xscale("log")
        axes.set_xticks(values, [_format(v) for v in values])
        axes.minorticks_off()


def _numeric(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else value


def _all_ints(distribution: Distribution) -> bool:
    if isinstance(distribution, Choice):
        return all(isinstance(v, int) and not isinstance(v, bool) for v in distribution.values)
    return isinstance(distribution, IntRange)


def _plain(value: Any, distribution: Distribution) -> Any:
    """A DataFrame cell back to the value the trial ran with (JobConfig wants int, not numpy.int64)."""
    if isinstance(distribution, Choice):
        return next(v for v in distribution.values if v == value)
    value = value.item() if hasattr(value, "item") else value
    return int(value) if isinstance(distribution, IntRange) else float(value)


def _format(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _png_base64(figure: Figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()
