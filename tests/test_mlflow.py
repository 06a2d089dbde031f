"""MLflow tracking: every step's metrics, the evaluations, params, artifacts and status, read back from a real store."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

mlflow = pytest.importorskip("mlflow")

from raylastic.cluster.tracking import MlflowLog, store_uri  # noqa: E402
from tests.support.helpers import job, load_model, run_status  # noqa: E402


def step_row(step: int) -> dict:
    return {"step": step, "time_s": 0.01 * step, "loss": 2.0 / step, "samples": 48, "samples_per_s": 900.0,
            "world_size": 2, "step_s": 0.01, "bytes_sent": 1000, "uncompressed_bytes": 1000, "lr": 0.001,
            "grad_norm": 1.5}


def write_result(run_dir: Path, status: str, **fields) -> Path:
    path = run_dir / "result.json"
    path.write_text(json.dumps({"status": status, **fields}))
    return path


def only_run(client, experiment: str = "raylastic"):
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1
    return runs[0]


def test_store_uri_maps_a_directory_to_sqlite_and_passes_uris_through(tmp_path: Path) -> None:
    assert store_uri(str(tmp_path / "mlruns")) == (f"sqlite:///{tmp_path}/mlruns/mlflow.db",
                                                   (tmp_path / "mlruns" / "artifacts").as_uri())
    for uri in ("http://mlflow:5000", "https://mlflow.example.com", "sqlite:////tmp/x.db", "file:///tmp/mlruns"):
        assert store_uri(uri) == (uri, None)
    (tmp_path / "legacy" / "0").mkdir(parents=True)
    (tmp_path / "legacy" / "0" / "meta.yaml").write_text("name: Default\n")
    assert store_uri(str(tmp_path / "legacy")) == ((tmp_path / "legacy").as_uri(), None)  # an existing file store


def test_steps_evaluations_params_artifacts_and_status_reach_mlflow(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = job(f"tracking.mlflow_uri={tmp_path / 'mlruns'}", "optim.lr=0.003", "workload.options={}",
                 name="unit")
    log = MlflowLog(config.tracking, config, run_dir)
    batches, log_batch = [], log.client.log_batch
    log.client.log_batch = lambda run_id, **kw: batches.append(len(kw.get("metrics", ()))) or log_batch(run_id, **kw)
    events = [{"type": "worker_failed", "step": 7, "time_s": 0.07, "worker": "w1"},
              {"type": "recovered", "step": 7, "time_s": 0.5, "world_size": 1}]
    log.update(run_status([step_row(s) for s in range(1, 8)], events=events[:1]))
    log.update(run_status([*map(step_row, range(8, 11)), {"step": 10, "time_s": 0.11, "eval": {"eval_loss": 1.9}}],
                events=events[1:]))
    # 9 metrics a step: more than MLflow's 1000 a batch
    log.update(run_status([step_row(s) for s in range(11, 151)], events=[],
                evaluations=[{"step": 150, "time_s": 1.6, "eval_loss": 1.2, "accuracy": 0.9}]))
    state = torch.nn.Linear(3, 2).state_dict()
    torch.save(state, run_dir / "model.pt")
    result_path = write_result(run_dir, "finished", final_step=150, metrics={"loss": 0.01, "accuracy": 0.9})
    log.finish("finished", model_path=run_dir / "model.pt", result_path=result_path)
    assert max(batches) == 1000 and sum(batches) == 150 * 9 + 3 + 2  # REST servers refuse bigger batches

    client = mlflow.MlflowClient(log.tracking_uri)
    run = only_run(client)
    assert run.info.run_name == "unit" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["optim.lr"] == "0.003" and params["training.steps"] == "20" and params["workload.options"] == "{}"
    assert params["faults"] == "[]" and params["tracking.mlflow_uri"] == str(tmp_path / "mlruns")
    assert run.data.tags["raylastic.workload"] == "digits" and run.data.tags["raylastic.run_dir"] == str(run_dir)
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in loss) == list(range(1, 151))
    assert {m.step: m.value for m in loss}[4] == pytest.approx(0.5)
    for name in ("lr", "grad_norm", "samples_per_s", "world_size"):
        assert len(client.get_metric_history(run.info.run_id, name)) == 150
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_loss")] == [(10, 1.9),
                                                                                                    (150, 1.2)]
    assert run.data.metrics["final_accuracy"] == 0.9 and run.data.metrics["final_loss"] == 0.01
    assert "step" not in run.data.metrics and "time_s" not in run.data.metrics

    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"model.pt", "result.json", "events.json"}
    downloaded = Path(client.download_artifacts(run.info.run_id, "model.pt", str(tmp_path / "down")))
    loaded = torch.load(downloaded, weights_only=True)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    assert json.loads(Path(client.download_artifacts(run.info.run_id, "events.json", str(tmp_path))).read_text()) \
        == events


@pytest.mark.parametrize(("status", "mlflow_status"), [("failed", "FAILED"), ("stopped", "KILLED")])
def test_a_failed_or_stopped_job_ends_its_run_so(tmp_path: Path, status: str, mlflow_status: str) -> None:
    config = job(f"tracking.mlflow_uri={tmp_path / 'mlruns'}", name="broken")
    log = MlflowLog(config.tracking, config, tmp_path)
    log.update(run_status([step_row(1)], events=[{"type": "worker_failed", "step": 2, "time_s": 0.1}]))
    log.finish(status, model_path=None, result_path=write_result(tmp_path, "failed", error="boom", final_step=1))

    client = mlflow.MlflowClient(log.tracking_uri)
    run = only_run(client)
    assert run.info.status == mlflow_status
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"result.json", "events.json"}


def test_an_mlflow_error_during_the_run_warns_once_and_stops_logging(tmp_path: Path) -> None:
    config = job(f"tracking.mlflow_uri={tmp_path / 'mlruns'}", "tracking.mlflow_experiment=flaky", name="flaky")
    log = MlflowLog(config.tracking, config, tmp_path)
    log.update(run_status([step_row(1)], events=[]))
    calls = []

    def unavailable(*args, **kwargs):
        calls.append(args)
        raise mlflow.exceptions.MlflowException("the tracking server went away")

    log.client.log_batch = unavailable
    with pytest.warns(RuntimeWarning, match="the tracking server went away"):
        log.update(run_status([step_row(2)], events=[]))
    log.update(run_status([step_row(3)], events=[]))  # no second warning, no further call
    assert len(calls) == 1
    log.finish("finished", model_path=None, result_path=None)

    client = mlflow.MlflowClient(log.tracking_uri)
    run = only_run(client, "flaky")
    assert run.info.status == "FINISHED"  # still ended, so it does not stay RUNNING
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1]


@pytest.mark.parametrize("uri", ["nosuchscheme://host/mlruns", "file:///{tmp}/filestore"])
def test_an_unusable_uri_fails_fast_naming_the_field(tmp_path: Path, uri: str, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow 3 refuses file stores without it
    if uri.startswith("file:") and not hasattr(mlflow.environment_variables, "MLFLOW_ALLOW_FILE_STORE"):
        pytest.skip("this MLflow still accepts file stores")
    config = job(f"tracking.mlflow_uri={uri.format(tmp=tmp_path)}")
    with pytest.raises(ValueError, match="tracking.mlflow_uri"):
        MlflowLog(config.tracking, config, tmp_path)


def test_missing_mlflow_says_how_to_install_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # makes `import mlflow` raise ImportError
    config = job(f"tracking.mlflow_uri={tmp_path}")
    with pytest.raises(ValueError, match=r"pip install 'raylastic\[mlflow\]'"):
        MlflowLog(config.tracking, config, tmp_path)


@pytest.mark.usefixtures("ray_local")
def test_a_training_run_logs_every_step_and_its_model(tmp_path: Path) -> None:
    from raylastic.cluster.job import train

    run_dir = tmp_path / "run"
    config = job(f"tracking.mlflow_uri={tmp_path / 'mlruns'}", "eval.every_steps=10", name="mlflow-e2e")
    train(config, run_dir=run_dir)

    client = mlflow.MlflowClient(store_uri(str(tmp_path / "mlruns"))[0])
    run = only_run(client)
    assert run.info.run_name == "mlflow-e2e" and run.info.status == "FINISHED"
    assert run.data.params["training.steps"] == "20"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 21))
    result = json.loads((run_dir / "result.json").read_text())
    evaluated = [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")]
    assert evaluated == [row["step"] for row in result["eval_history"]] and 10 in evaluated
    assert run.data.metrics["final_accuracy"] == pytest.approx(result["metrics"]["accuracy"])
    downloaded = Path(client.download_artifacts(run.info.run_id, "model.pt", str(tmp_path / "down")))
    loaded, written = torch.load(downloaded, weights_only=True), load_model(run_dir)
    assert loaded.keys() == written.keys() and all(torch.equal(loaded[k], written[k]) for k in written)


def test_a_stop_from_outside_ends_the_run_as_stopped_and_an_error_as_failed() -> None:
    from raylastic.cluster.job import RunFailed, RunStopped, _ended_as

    assert _ended_as(RunStopped("run stopped by the user at step 3 (Ctrl-C)")) == "stopped"  # as _follow raises it
    assert _ended_as(KeyboardInterrupt()) == "stopped"  # Ctrl-C before the poll began
    assert _ended_as(SystemExit(1)) == "stopped"  # a BaseException from outside, e.g. a Tune trial stopped
    assert _ended_as(RunFailed("worker 1 failed 4 times")) == "failed"
