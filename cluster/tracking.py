"""Run metrics for MLflow, logged by the driver when ``tracking.mlflow_uri`` is set.

Example::

    raylastic train --set tracking.mlflow_uri=mlruns
    mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db     # then open http://127.0.0.1:5000

One MLflow run per job, named after ``job.name``, in the experiment ``tracking.mlflow_experiment``:

- params: the job's config flattened to the ``--set`` keys (``optim.lr``), lists and empty mappings as JSON;
- tags: ``raylastic.version``, ``raylastic.workload``, ``raylastic.strategy``, ``raylastic.run_dir``;
- metrics: every step row's numbers (loss, lr, grad_norm, samples_per_s, world_size, ...) at its step, and every
  evaluation's (``eval_loss``, ``accuracy``, ...) at its step; at the end result.json's metrics as ``final_<name>``;
- artifacts at the end: ``result.json``, ``model.pt`` (on success) and ``events.json`` (the run's events);
- the status: FINISHED, FAILED, or KILLED (stopped: Ctrl-C, SIGTERM, a Tune trial stopped).

Where it goes. A URI with a scheme (``http://``, ``https://``, ``sqlite:///``, ``file:///``, ...) is MLflow's
to resolve. A plain directory (``mlruns``, relative to the current directory) becomes a SQLite store inside
it, ``<dir>/mlflow.db`` with artifacts under ``<dir>/artifacts``: MLflow 3 keeps its ``mlruns`` file store in
maintenance mode and (3.17) refuses it unless ``MLFLOW_ALLOW_FILE_STORE=true`` is set, which is the user's
call, not ours. A directory that already holds a file store (``<dir>/0/meta.yaml``, ...) stays one.

The run is created at the first progress (with the job's start time), so a job that never starts, like
one that never writes result.json, leaves no run behind. MLflow is called through an ``MlflowClient`` with an
explicit URI, never the fluent ``mlflow.start_run`` state: several jobs may log from one process (Ray Tune).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse, urlsplit
from urllib.request import pathname2url

from raylastic.actors.status.run import RunStatus
from raylastic.jobconfig import JobConfig, TrackingConfig

RunEnd = Literal["finished", "failed", "stopped"]
"""How a job ended (result.json's status)."""
MLFLOW_STATUS: dict[str, str] = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}
"""MLflow's run status for each end: a run stopped from outside is KILLED there."""
MISSING_MLFLOW = "tracking.mlflow_uri is set but mlflow is not installed: pip install 'raylastic[mlflow]'"
BATCH_SIZE = 1000  # MLflow's limit on metrics per log_batch (and on entities per batch)
PARAMS_PER_BATCH = 100  # MLflow's limit on params per log_batch
REDACTED = "***"
NOT_METRICS = ("step", "time_s")  # the step is the metric's step; time_s its timestamp


class MlflowLog:
    """Feed it the Controller's ``progress()`` dicts (as TensorBoardLog is fed), then ``finish`` it.

    Example::

        log = MlflowLog(job.tracking, job, run_dir)
        log.update({"history": [{"step": 1, "time_s": 0.2, "loss": 2.3}], "events": []})
        log.finish("finished", model_path=run_dir / "model.pt", result_path=run_dir / "result.json")

    A URI MLflow cannot use raises ValueError here; an MLflow error later warns once and ends the logging,
    never the training.
    """

    def __init__(self, tracking: TrackingConfig, job: JobConfig, run_dir: Path) -> None:
        try:
            import mlflow
        except ImportError as error:
            raise ValueError(MISSING_MLFLOW) from error
        assert tracking.mlflow_uri is not None, "MlflowLog needs tracking.mlflow_uri"
        self.tracking_uri, artifact_location = store_uri(tracking.mlflow_uri)
        try:
            if artifact_location is not None:
                Path(tracking.mlflow_uri).expanduser().mkdir(parents=True, exist_ok=True)
            self.client = mlflow.MlflowClient(self.tracking_uri)
            self.experiment_id = _experiment_id(self.client, tracking.mlflow_experiment, artifact_location)
        except ValueError:
            raise
        except Exception as error:  # MlflowException, OSError, a connection error: the URI is not usable
            raise ValueError(f"tracking.mlflow_uri={tracking.mlflow_uri!r}: MLflow cannot use it "
                             f"({self.tracking_uri}): {error}") from error
        self.job, self.run_dir = job, run_dir
        self.run_id: str | None = None
        self.events: list[dict[str, Any]] = []
        self._start_ms = int(time.time() * 1000)
        self._failed = False

    def update(self, progress: RunStatus) -> None:
        """Log the progress's new step rows and evaluations as metrics; keep its events for the end."""
        self.events.extend(event.to_dict() for event in progress.events)
        rows = [*progress.history, *progress.evaluations]
        metrics = [metric for row in rows for metric in self._metrics(row)]
        self._guarded(self._log_metrics, metrics)

    def finish(self, status: RunEnd, model_path: Path | None, result_path: Path | None) -> None:
        """Log result.json (its metrics as ``final_<name>``), model.pt and events.json; end the run as ``status``
        (MLFLOW_STATUS)."""
        self._guarded(self._log_outcome, model_path, result_path)
        if self.run_id is not None:  # ended even after a logging error, so the run does not stay RUNNING
            try:
                self.client.set_terminated(self.run_id, MLFLOW_STATUS[status])
            except Exception as error:
                if not self._failed:
                    self._warn(error)

    def _log_outcome(self, model_path: Path | None, result_path: Path | None) -> None:
        run_id = self._run_id()
        if result_path is not None and result_path.exists():
            result = json.loads(result_path.read_text())
            final = {f"final_{key}": value for key, value in (result.get("metrics") or {}).items()}
            self._log_metrics(list(self._metrics({"step": result.get("final_step") or 0, **final}, now=True)))
            self.client.log_artifact(run_id, str(result_path))
        self.client.log_dict(run_id, self.events, "events.json")
        if model_path is not None:
            self.client.log_artifact(run_id, str(model_path))

    def _metrics(self, row: dict[str, Any], now: bool = False) -> Iterator[Any]:
        """MLflow Metrics of a step row's or an evaluation's numbers (also those of an ``eval`` mapping in it)."""
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000) if now else self._start_ms + int(1000 * row.get("time_s", 0.0))
        values = {**{k: v for k, v in row.items() if k != "eval"}, **(row.get("eval") or {})}
        for key, value in values.items():
            if key not in NOT_METRICS and isinstance(value, (int, float)) and not isinstance(value, bool):
                yield Metric(_valid_key(key), float(value), timestamp, int(row["step"]))

    def _log_metrics(self, metrics: list[Any]) -> None:
        run_id = self._run_id()
        for start in range(0, len(metrics), BATCH_SIZE):
            self.client.log_batch(run_id, metrics=metrics[start:start + BATCH_SIZE])

    def _run_id(self) -> str:
        """The MLflow run, created (with the job's params and tags) the first time it is needed."""
        if self.run_id is None:
            from mlflow.entities import Param

            run = self.client.create_run(self.experiment_id, start_time=self._start_ms, run_name=self.job.name,
                                         tags=self._tags())
            self.run_id = run.info.run_id
            params = [Param(key, value) for key, value in flatten_params(shown_config(self.job)).items()]
            for start in range(0, len(params), PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=params[start:start + PARAMS_PER_BATCH])
        return self.run_id

    def _tags(self) -> dict[str, str]:
        try:
            version = importlib.metadata.version("raylastic")
        except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
            version = "unknown"
        return {"raylastic.version": version, "raylastic.workload": self.job.workload.name,
                "raylastic.strategy": self.job.strategy.name, "raylastic.run_dir": str(self.run_dir)}

    def _guarded(self, log: Any, *args: Any) -> None:
        """Call ``log``; after an MLflow error, warn once and log nothing more: tracking never ends a run."""
        if self._failed:
            return
        try:
            log(*args)
        except Exception as error:  # whatever MLflow or its store raise (MlflowException, OSError, HTTP errors)
            self._failed = True
            self._warn(error)

    def _warn(self, error: Exception) -> None:
        warnings.warn(f"MLflow logging to {self.tracking_uri} failed; the run goes on without it: {error!r}",
                      RuntimeWarning, stacklevel=2)


def store_uri(uri: str) -> tuple[str, str | None]:
    """The URI MLflow gets for ``tracking.mlflow_uri``, and the artifact location of an experiment it creates.

    Example::

        >>> store_uri("/srv/mlruns")
        ('sqlite:////srv/mlruns/mlflow.db', 'file:///srv/mlruns/artifacts')
        >>> store_uri("http://mlflow:5000")
        ('http://mlflow:5000', None)
    """
    if urlparse(uri).scheme or uri == "databricks":
        return uri, None
    directory = Path(uri).expanduser().absolute()
    if any((entry / "meta.yaml").exists() for entry in directory.glob("[0-9]*")):  # an mlruns file store
        return directory.as_uri(), None
    return f"sqlite:///{pathname2url(str(directory / 'mlflow.db'))}", (directory / "artifacts").as_uri()


def shown_config(job: JobConfig) -> dict[str, Any]:
    """The job's config as result.json and the MLflow params show it: ``tracking.mlflow_uri`` without credentials."""
    config = job.to_dict()
    config["tracking"]["mlflow_uri"] = redacted_uri(config["tracking"]["mlflow_uri"])
    return config


def redacted_uri(uri: str | None) -> str | None:
    """``uri`` with its user info (``user:password@``) and every query value (a token) as ``***``; a plain path as
    it is.

    Example::

        >>> redacted_uri("https://alice:s3cret@mlflow.example.com/api?token=abc&x")
        'https://***@mlflow.example.com/api?token=***&x'
    """
    if not uri:
        return uri
    parts = urlsplit(uri)
    shown = uri
    if "@" in parts.netloc:
        shown = shown.replace(parts.netloc, f"{REDACTED}@{parts.netloc.rsplit('@', 1)[1]}", 1)
    if parts.query:
        query = "&".join(f"{name}={REDACTED}" if sep else name
                         for name, sep, _ in (item.partition("=") for item in parts.query.split("&")))
        shown = shown.replace(f"?{parts.query}", f"?{query}", 1)
    return shown


def flatten_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as MLflow params: ``--set`` style dotted keys, string values within MLflow's 6000 characters.

    Example::

        >>> flatten_params({"optim": {"lr": 0.001}, "workload": {"options": {}}, "faults": []})
        {'optim.lr': '0.001', 'workload.options': '{}', 'faults': '[]'}
    """
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(flatten_params(value, prefix=f"{name}."))
        else:
            text = json.dumps(value, default=str) if isinstance(value, (dict, list, tuple)) else str(value)
            params[_valid_key(name)] = text[:6000]
    return params


def _experiment_id(client: Any, name: str, artifact_location: str | None) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location)
        except Exception:  # another job (a parallel Tune trial) created it first
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage != "active":
        raise ValueError(f"tracking.mlflow_experiment={name!r} is deleted in this MLflow store; restore it "
                         "(mlflow experiments restore) or choose another name")
    return experiment.experiment_id


def _valid_key(name: str) -> str:
    """``name`` with what MLflow refuses in metric and param names (all but ``\\w``, ``/ . - :`` and space) as ``_``."""
    return re.sub(r"[^\w/.\- :]", "_", name)
