"""Search spaces and the pure parts of a sweep: parsed, validated against the job, no Ray."""

from __future__ import annotations

import math

import pytest

from raylastic.jobconfig import JobConfig, ScalingConfig, StrategyConfig
from raylastic.tuning.search_space import (
    DEFAULT_SEARCH_SPACE,
    Choice,
    IntRange,
    LogUniform,
    SearchSpace,
    Uniform,
    tunable_keys,
)
from raylastic.tuning.trial import trial_job, trial_resources
from raylastic.tuning.tuner import concurrent_trials

BASE = JobConfig()


def validated(raw: dict) -> SearchSpace:
    space = SearchSpace.from_dict(raw)
    space.validate(BASE)
    return space


def test_parses_every_distribution_and_round_trips():
    raw = {"optim.lr": {"loguniform": [1e-4, "1e-1"]}, "optim.weight_decay": {"uniform": {"low": 0, "high": 0.1}},
           "training.steps": {"int": [20, 60]}, "training.global_batch_size": {"choice": [32, 64, 128]}}
    space = validated(raw)
    assert space.parameters == {"optim.lr": LogUniform(1e-4, 0.1), "optim.weight_decay": Uniform(0.0, 0.1),
                                "training.steps": IntRange(20, 60), "training.global_batch_size": Choice((32, 64, 128))}
    assert SearchSpace.from_dict(space.to_dict()) == space


def test_keys_may_be_nested_in_sections():
    assert validated({"optim": {"lr": {"loguniform": [1e-4, 1e-1]}}}).parameters == {"optim.lr": LogUniform(1e-4, 0.1)}


def test_tunable_keys_come_from_the_config_dataclasses():
    keys = tunable_keys()
    assert {"optim.lr", "training.global_batch_size", "strategy.bucket_cap_mb", "strategy.name",
            "strategy.compression"} <= set(keys)
    assert not {"name", "faults", "workload.name", "checkpoint.path"} & set(keys)
    assert not any(key.startswith("scaling.") for key in keys)
    DEFAULT_SEARCH_SPACE.validate(BASE)


@pytest.mark.parametrize(("raw", "message"), [
    ({"optim.learning_rate": {"loguniform": [1e-4, 1e-1]}}, "unknown key optim.learning_rate; tunable keys: .*lr"),
    ({"optim.lr": {"loguniform": [1e-1, 1e-4]}}, r"optim.lr: empty range: low \(0.1\) must be below high"),
    ({"optim.lr": {"uniform": [0.01, 0.01]}}, "optim.lr: empty range"),
    ({"optim.lr": {"uniform": [-0.1, 0.1]}}, r"optim.lr: the value -0.1 is not allowed: optim.lr must be a number in"),
    ({"strategy.bucket_cap_mb": {"choice": [5, -1]}}, "bucket_cap_mb: the value -1 is not allowed: .*positive"),
    ({"training.global_batch_size": {"int": [0, 64]}}, "global_batch_size: the value 0 is not allowed"),
    ({"training.global_batch_size": {"choice": [1, 64]}}, "cannot be split across scaling.max_workers"),
    ({"optim.lr": {"loguniform": [0, 1e-1]}}, "loguniform needs 0 < low"),
    ({"training.global_batch_size": {"uniform": [16, 128]}}, "takes integers"),
    ({"training.steps": {"int": [1.5, 10]}}, "whole-number bounds"),
    ({"optim.lr": {"choice": []}}, "non-empty list"),
    ({"optim.lr": {"normal": [0, 1]}}, "expected one of {loguniform"),
    ({"optim.lr": {"uniform": [0, math.inf]}}, "finite numbers"),
    ({"scaling.max_workers": {"int": [1, 4]}}, "scaling.max_workers cannot be swept .*placement group"),
    ({"name": {"choice": ["a", "b"]}}, "name cannot be swept"),
    ({}, "search space is empty"),
    ({"strategy.name": {"choice": ["ddp", "zero2"]}, "strategy.compression": {"choice": ["none", "fp16"]}},
     "strategy.name='zero2', strategy.compression='fp16' is not a valid job: .*sweep such keys separately"),
])
def test_bad_search_space_is_a_clear_error(raw, message):
    with pytest.raises(ValueError, match=message):
        validated(raw)


def test_apply_builds_the_trials_job():
    job = trial_job(BASE, DEFAULT_SEARCH_SPACE, {"optim.lr": 3e-3, "training.global_batch_size": 32,
                                                 "strategy.bucket_cap_mb": 5}, sweep_name="s", trial_id="ab12_00001")
    assert (job.name, job.optim.lr, job.training.global_batch_size, job.strategy.bucket_cap_mb) == (
        "s-ab12_00001", 3e-3, 32, 5.0)
    assert job.scaling == BASE.scaling


def test_points_to_evaluate_are_completed_from_the_base_job_and_checked():
    assert DEFAULT_SEARCH_SPACE.complete_point(BASE, {"optim.lr": 1e-3}) == {
        "optim.lr": 1e-3, "training.global_batch_size": 64, "strategy.bucket_cap_mb": 25}
    with pytest.raises(ValueError, match="optim.lr=1e-06 is outside"):
        DEFAULT_SEARCH_SPACE.complete_point(BASE, {"optim.lr": 1e-6})
    with pytest.raises(ValueError, match="optim.momentum is not in the search space"):
        DEFAULT_SEARCH_SPACE.complete_point(BASE, {"optim.momentum": 0.5})


def test_trial_reserves_a_driver_bundle_and_one_bundle_per_worker():
    job = JobConfig(scaling=ScalingConfig(min_workers=1, max_workers=3, cpus_per_worker=0.5,
                                          resources_per_worker={"slot": 1}))
    assert trial_resources(job).bundles == [{"CPU": 0.01}] + [{"CPU": 0.5, "slot": 1}] * 3


def test_an_async_trial_also_reserves_its_parameter_servers():
    job = JobConfig(scaling=ScalingConfig(min_workers=1, max_workers=2, cpus_per_worker=0.5),
                    strategy=StrategyConfig(name="async_ps", num_servers=2, server_cpus=0.25))
    assert trial_resources(job).bundles == [{"CPU": 0.01}] + [{"CPU": 0.5}] * 2 + [{"CPU": 0.25}] * 2
    space = SearchSpace.from_dict({"strategy.max_staleness": {"choice": [0, 4]}})
    space.validate(job)
    assert space.apply(job, {"strategy.max_staleness": 0}).strategy.max_staleness == 0


def test_concurrent_trials_fit_the_cluster():
    assert concurrent_trials({"CPU": 1.01}, {"CPU": 4.0}, None) == 3
    assert concurrent_trials({"CPU": 1.01}, {"CPU": 4.0}, 2) == 2
    assert concurrent_trials({"CPU": 0.51, "GPU": 2}, {"CPU": 16.0, "GPU": 4}, None) == 2
    with pytest.raises(ValueError, match="one trial needs .*GPU.*the cluster has"):
        concurrent_trials({"CPU": 0.51, "GPU": 1}, {"CPU": 16.0}, None)
    with pytest.raises(ValueError, match="max_concurrent_trials must be a positive integer"):
        concurrent_trials({"CPU": 1.01}, {"CPU": 4.0}, 0)


@pytest.mark.parametrize(("options", "message"), [
    ({"name": "my sweep"}, "name must be letters, digits"),
    ({"num_samples": 0}, "num_samples must be a positive integer"),
    ({"mode": "up"}, "mode must be min or max"),
    ({"points_to_evaluate": [{"optim.lr": 1.0}]}, "optim.lr=1.0 is outside"),
])
def test_bad_sweep_arguments_fail_before_ray_starts(options, message):
    import ray

    from raylastic.tuning import sweep

    with pytest.raises(ValueError, match=message):
        sweep(BASE, **options)
    assert not ray.is_initialized()


def test_cli_reports_a_bad_search_space_with_exit_code_2(tmp_path, capsys):
    from raylastic.cluster.cli import main

    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {loguniform: [0.1, 0.001]}\n")
    assert main(["sweep", "--space", str(space), "--storage-path", str(tmp_path)]) == 2
    assert "optim.lr: empty range" in capsys.readouterr().err
    space.write_text("optim.learning_rate: {loguniform: [0.001, 0.1]}\n")
    assert main(["sweep", "--space", str(space), "--storage-path", str(tmp_path)]) == 2
    assert "unknown key optim.learning_rate" in capsys.readouterr().err
