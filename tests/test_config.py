"""JobConfig validation, loading from YAML plus ``--set`` overrides, and the workload resolver; no Ray.

    python -m pytest tests/test_config.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from raylastic.jobconfig import (
    OPTIMIZERS,
    STRATEGIES,
    JobConfig,
    OptimConfig,
    WorkloadConfig,
    job_config_from_dict,
    load_job_config,
)
from raylastic.jobconfig.naming import controller_name, run_of_controller, run_prefix, slot_name, worker_name
from raylastic.workloads import BUILTIN_WORKLOADS, resolve_workload_class
from raylastic.workloads.digits import Digits


def _error(overrides: list[str]) -> str:
    with pytest.raises(ValueError) as raised:
        load_job_config(None, overrides)
    return str(raised.value)


# Each case: the overrides, and the fragments the error message must contain (the field and what is allowed).
BAD_OVERRIDES = [
    pytest.param(["training.steps=0"], ["training.steps", "positive integer"], id="steps-zero"),
    pytest.param(["training.steps=-5"], ["training.steps", "positive integer"], id="steps-negative"),
    pytest.param(["training.global_batch_size=0"], ["training.global_batch_size", "positive integer"],
                 id="global-batch-zero"),
    pytest.param(["training.global_batch_size=-64"], ["training.global_batch_size", "positive integer"],
                 id="global-batch-negative"),
    pytest.param(["training.micro_batch_size=0"], ["training.micro_batch_size", "positive integer or null"],
                 id="micro-batch-zero"),
    pytest.param(["training.micro_batch_size=-2"], ["training.micro_batch_size", "positive integer or null"],
                 id="micro-batch-negative"),
    pytest.param(["training.seed=-1"], ["training.seed", "[0, 2**32)"], id="seed-negative"),
    pytest.param(["scaling.min_workers=0"], ["scaling.min_workers", "positive integer"], id="min-workers-zero"),
    pytest.param(["scaling.max_workers=0"], ["scaling.max_workers", "positive integer"], id="max-workers-zero"),
    pytest.param(["scaling.max_workers=-1"], ["scaling.max_workers", "positive integer"],
                 id="max-workers-negative"),
    pytest.param(["scaling.min_workers=3", "scaling.max_workers=2"],
                 ["scaling.min_workers (3)", "scaling.max_workers (2)", "<="], id="min-above-max"),
    pytest.param(["scaling.cpus_per_worker=0"], ["scaling.cpus_per_worker", "positive number"], id="cpus-zero"),
    pytest.param(["scaling.cpus_per_worker=-0.5"], ["scaling.cpus_per_worker", "positive number"],
                 id="cpus-negative"),
    pytest.param(["training.global_batch_size=3", "scaling.min_workers=1", "scaling.max_workers=4"],
                 ["training.global_batch_size (3)", "scaling.max_workers (4)", "cannot be split"],
                 id="batch-below-max-workers"),
    pytest.param(["strategy.name=fsdp"], ["strategy.name", "'fsdp'", *STRATEGIES], id="unknown-strategy"),
    pytest.param(["strategy.bucket_cap_mb=0"], ["strategy.bucket_cap_mb", "positive"], id="bucket-zero"),
    pytest.param(["strategy.bucket_cap_mb=-25"], ["strategy.bucket_cap_mb", "positive"], id="bucket-negative"),
    pytest.param(["strategy.comm_timing=maybe"], ["strategy.comm_timing", "true or false"], id="comm-timing-not-bool"),
    pytest.param(["strategy.name=zero1", "strategy.comm_timing=true"], ["strategy.comm_timing", "ddp only"],
                 id="comm-timing-not-ddp"),
    pytest.param(["strategy.name=zero3", "strategy.replicas=0"], ["strategy.replicas", "positive integer"],
                 id="replicas-zero"),
    pytest.param(["strategy.name=zero3", "strategy.replicas=2.0"], ["strategy.replicas", "positive integer"],
                 id="replicas-float"),
    pytest.param(["strategy.replicas=2"], ["strategy.replicas > 1", "zero1, zero2 or zero3", "'ddp'"],
                 id="replicas-with-ddp"),
    *[pytest.param([f"strategy.{key}={value}"], [f"strategy.{key}", allowed], id=f"{key}-{value}")
      for key, value, allowed in (("powersgd_rank", 0, "positive integer"), ("powersgd_rank", 2.0, "positive integer"),
                                  ("powersgd_start_iter", 1, ">= 2"), ("topk_fraction", 0, "(0, 1]"),
                                  ("topk_fraction", 1.5, "(0, 1]"), ("topk_fraction", ".nan", "(0, 1]"),
                                  ("onebit_warmup_steps", -1, "non-negative integer"),
                                  ("onebit_warmup_steps", "true", "non-negative integer"))],
    pytest.param(["optim.lr=0"], ["optim.lr", "(0, 10]"], id="lr-zero"),
    pytest.param(["optim.lr=-3e-3"], ["optim.lr", "(0, 10]"], id="lr-negative"),
    pytest.param(["optim.lr=nan"], ["optim.lr", "(0, 10]"], id="lr-nan"),
    pytest.param(["optim.name=lamb"], ["optim.name", "'lamb'", *OPTIMIZERS], id="unknown-optimizer"),
    pytest.param(["training.stepz=3"], ["unknown key training.stepz", "steps", "global_batch_size", "seed"],
                 id="unknown-key"),
    pytest.param(["trainingg.steps=3"], ["unknown key trainingg", "training", "scaling", "optim"],
                 id="unknown-section"),
    pytest.param(["training=3"], ["training", "mapping", "3"], id="value-for-section"),
    pytest.param(["training.steps=3", "training.steps.x=4"], ["--set training.steps.x", "'steps' is a value"],
                 id="field-used-as-section"),
    pytest.param(["training.steps"], ["--set 'training.steps'", "section.field=value"], id="no-equals"),
    pytest.param(["=3"], ["--set '=3'", "section.field=value"], id="no-key"),
    pytest.param(["workload.name="], ["workload.name", "non-empty string"], id="empty-workload-name"),
    pytest.param(["training=0"], ["training", "mapping"], id="falsy-section-value"),
    pytest.param(["training.steps=[1"], ["training.steps"], id="unparsable-value"),
    pytest.param(["failure.max_failures=true"], ["failure.max_failures"], id="bool-max-failures"),
    pytest.param(["checkpoint.every_steps=true"], ["checkpoint.every_steps"], id="bool-every-steps"),
    *[pytest.param([f"checkpoint.every_minutes={value}"], ["checkpoint.every_minutes", "[0, 10080]", "(0: off)"],
                   id=f"every-minutes-{value}") for value in ("-1", "10081", ".nan", "true", "soon")],
    pytest.param(["scaling.cpus_per_worker=.inf"], ["scaling.cpus_per_worker"], id="cpus-infinite"),
    pytest.param(["faults=[{action: kill}]"], ["missing faults[0].rank (a non-negative integer)",
                                              "faults[0].step (a positive integer)", "action, rank, step"],
                 id="fault-without-rank-and-step"),
    pytest.param(["faults=[{rank: 1, step: 3}]"], ["missing faults[0].action (one of kill, ray_kill"],
                 id="fault-without-action"),
    pytest.param(["faults=[{action: kill, rank: 1, step: 3}, {action: stall, step: 4}]"],
                 ["missing faults[1].rank"], id="second-fault-without-rank"),
    pytest.param(["faults=[{action: explode, rank: 1, step: 3}]"], ["faults[].action", "kill, ray_kill"],
                 id="fault-unknown-action"),
    pytest.param(["faults=[{action: kill, rank: 2, step: 3}]"], ["faults[0].rank", "below scaling.max_workers (2)"],
                 id="fault-rank-never-exists"),
    pytest.param(["training.steps=10", "faults=[{action: kill, rank: 1, step: 11}]"],
                 ["faults[0].step", "at most training.steps (10)"], id="fault-step-never-runs"),
    pytest.param(["faults={action: kill, rank: 1, step: 3}"], ["faults must be a list"], id="faults-not-a-list"),
    pytest.param(["faults=[{action: throttle, rank: 1, step: 3, factor: 0.5}]"],
                 ["faults[].factor must be a number > 1 for a throttle", "got 0.5"], id="throttle-speeds-up"),
    pytest.param(["faults=[{action: throttle, rank: 1, step: 3, factor: 2, until_step: 2}]"],
                 ["faults[].until_step must be None or a step >= faults[].step (3)"], id="throttle-ends-first"),
    pytest.param(["faults=[{action: kill, rank: 1, step: 3, factor: 2}]"],
                 ["faults[].factor and faults[].until_step are for action throttle only"], id="kill-with-factor"),
    pytest.param(["scaling.balance=sometimes"], ["scaling.balance must be one of off, auto", "'sometimes'"],
                 id="balance-unknown"),
    pytest.param(["scaling.straggler_factor=1"], ["scaling.straggler_factor must be a number > 1"],
                 id="straggler-factor-1"),
    pytest.param(["scaling.warm_processes=sometimes"], ["scaling.warm_processes must be true or false",
                                                         "'sometimes'"], id="warm-processes-not-a-bool"),
    pytest.param(["scaling.resources_per_worker={CPU: 2}"],
                 ["scaling.resources_per_worker cannot reserve CPU", "scaling.cpus_per_worker"], id="resources-cpu"),
    pytest.param(["scaling.resources_per_worker={GPU: 1, worker_slot: 1}"],
                 ["scaling.resources_per_worker cannot reserve GPU", "scaling.use_gpu"], id="resources-gpu"),
    *[pytest.param([f"{key}={value}"], [key, f"seconds in [{low}, 86400] (a day)", f"got {float(value)}"],
                   id=f"{key.split('.')[1]}-{value}")
      for key, low in (("failure.collective_timeout_s", 1), ("failure.step_timeout_s", 1),
                       ("failure.max_step_s", 1), ("scaling.placement_timeout_s", 10))
      for value in (0, 0.5, 86401)],
]


@pytest.mark.parametrize(("overrides", "fragments"), BAD_OVERRIDES)
def test_bad_value_names_field_and_what_is_allowed(overrides, fragments):
    message = _error(overrides)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_timeouts_accept_their_bounds():
    load_job_config(None, ["failure.collective_timeout_s=1", "failure.step_timeout_s=1", "failure.max_step_s=1",
                           "scaling.placement_timeout_s=10"])
    load_job_config(None, [f"{key}=86400" for key in ("failure.collective_timeout_s", "failure.step_timeout_s",
                                                       "failure.max_step_s", "scaling.placement_timeout_s")])


def test_unknown_key_lists_every_allowed_key():
    message = _error(["scaling.max_worker=3"])
    assert message.startswith("unknown key scaling.max_worker;")
    for key in ("min_workers", "max_workers", "use_gpu", "cpus_per_worker", "placement_timeout_s"):
        assert key in message


def test_bad_value_in_constructor_names_field():
    with pytest.raises(ValueError, match=r"optim\.name must be one of adamw, sgd, got 'lamb'"):
        OptimConfig(name="lamb")
    with pytest.raises(ValueError, match=r"workload\.name must be a non-empty string"):
        WorkloadConfig(name="")


# -- the YAML file ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "fragment"), [
    pytest.param("- training\n- optim\n", "expected a mapping of sections, got list", id="list"),
    pytest.param("42\n", "expected a mapping of sections, got int", id="scalar"),
    pytest.param("training: [\n", "--config", id="unparsable"),
])
def test_bad_yaml_file_is_named(tmp_path, text, fragment):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as raised:
        load_job_config(path)
    assert fragment in str(raised.value) and str(path) in str(raised.value)


@pytest.mark.parametrize("name", ["missing.yaml", "."], ids=["missing", "directory"])
def test_unreadable_yaml_file_is_named(tmp_path, name):
    path = tmp_path / name
    with pytest.raises(ValueError, match="cannot read it") as raised:
        load_job_config(path)
    assert str(raised.value).startswith(f"--config {path}:")


@pytest.mark.parametrize(("text", "fragment"), [
    pytest.param("training:\n  steps: 10\n  seed: 1\n  steps: 1000\n", "training.steps is given twice (lines 2 and 4)",
                 id="field"),
    pytest.param("optim:\n  lr: 0.1\ntraining: {}\noptim:\n  lr: 0.2\n", "optim is given twice (lines 1 and 4)",
                 id="section"),
    pytest.param("faults:\n- {action: kill, rank: 1, step: 5, rank: 0}\n", "faults[0].rank is given twice", id="list"),
])
def test_a_key_given_twice_in_the_yaml_file_is_refused_naming_it(tmp_path, text, fragment):
    """YAML keeps the last of two equal keys: the first value was dropped without a word."""
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="keep one") as raised:
        load_job_config(path)
    assert fragment in str(raised.value) and str(path) in str(raised.value)


def test_a_key_overriding_a_merged_one_is_no_repeat(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("optim:\n  <<: {lr: 0.1, momentum: 0.5}\n  lr: 0.2\n")
    optim = load_job_config(path).optim
    assert (optim.lr, optim.momentum) == (0.2, 0.5)


def test_balance_off_in_yaml_is_off_not_false(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("scaling:\n  balance: off\n")  # YAML 1.1 reads a bare off as false
    assert load_job_config(path, []).scaling.balance == "off"
    assert load_job_config(None, []).scaling.balance == "auto"


def test_empty_yaml_file_gives_defaults(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("# nothing set\n")
    assert load_job_config(path) == JobConfig()


def test_override_wins_over_file_and_file_over_defaults(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("training:\n  steps: 50\n  seed: 4\noptim:\n  lr: 0.01\nscaling:\n  max_workers: 3\n")
    job = load_job_config(path, ["training.steps=7", "optim.name=sgd"])
    assert job.training.steps == 7  # the override
    assert job.training.seed == 4 and job.optim.lr == 0.01 and job.scaling.max_workers == 3  # the file
    assert job.optim.name == "sgd"  # the override, for a key the file does not set
    assert job.training.global_batch_size == JobConfig().training.global_batch_size  # the default


def test_later_override_wins():
    assert load_job_config(None, ["training.steps=5", "training.steps=9"]).training.steps == 9


# -- coercion ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("override", "read", "expected"), [
    ("optim.lr=3e-3", lambda job: job.optim.lr, 3e-3),  # YAML 1.1 reads 3e-3 as a string
    ("optim.lr=1", lambda job: job.optim.lr, 1.0),
    ("optim.weight_decay=0", lambda job: job.optim.weight_decay, 0.0),
    ("scaling.cpus_per_worker=2", lambda job: job.scaling.cpus_per_worker, 2.0),
    ("strategy.bucket_cap_mb=1e1", lambda job: job.strategy.bucket_cap_mb, 10.0),
    ("checkpoint.every_minutes=0", lambda job: job.checkpoint.every_minutes, 0.0),
])
def test_numbers_are_coerced_to_float_for_float_fields(override, read, expected):
    value = read(load_job_config(None, [override]))
    assert value == expected and type(value) is float


def test_yaml_file_ints_and_strings_are_floats(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("optim:\n  lr: 2e-4\n  momentum: 0\nfailure:\n  step_timeout_s: 5\n")
    job = load_job_config(path)
    assert (job.optim.lr, job.optim.momentum, job.failure.step_timeout_s) == (2e-4, 0.0, 5.0)
    assert all(type(v) is float for v in (job.optim.lr, job.optim.momentum, job.failure.step_timeout_s))


def test_int_fields_are_not_coerced():
    assert "training.steps" in _error(["training.steps=1e3"])  # YAML gives the string '1e3'
    assert "training.steps" in _error(["training.steps=10.0"])
    assert "scaling.min_workers" in _error(["scaling.min_workers=true"])


# -- defaults, round trip, math hash ----------------------------------------------------------------------


def test_defaults_are_valid_and_loading_nothing_gives_them():
    job = JobConfig()
    assert job.training.global_batch_size >= job.scaling.max_workers >= job.scaling.min_workers >= 1
    assert load_job_config() == job


def test_to_dict_round_trips():
    job = load_job_config(None, ["name=rt", "training.steps=12", "optim.name=sgd", "optim.lr=0.05",
                                 "scaling.max_workers=3", "workload.options={hidden: 16}"])
    assert job_config_from_dict(job.to_dict()) == job


def _hash(*overrides: str) -> str:
    return load_job_config(None, list(overrides)).math_hash()


@pytest.mark.parametrize("override", ["optim.lr=3e-3", "optim.name=sgd", "training.seed=1",
                                      "training.global_batch_size=32", "workload.name=chargpt",
                                      "workload.options={hidden: 16}"])
def test_math_hash_changes_with_what_decides_the_parameters(override):
    assert _hash(override) != _hash()


@pytest.mark.parametrize("override", ["training.steps=7", "scaling.max_workers=4", "scaling.min_workers=1",
                                      "scaling.cpus_per_worker=0.5", "failure.max_failures=0",
                                      "checkpoint.every_steps=5", "checkpoint.every_minutes=0.5"])
def test_math_hash_ignores_length_and_scaling(override):
    assert _hash(override) == _hash()


def test_replicas_are_for_sharded_strategies_and_leave_the_math_alone():
    assert load_job_config(None, ["strategy.name=zero1", "strategy.replicas=3"]).strategy.replicas == 3
    assert _hash("strategy.name=zero3", "strategy.replicas=2") == _hash("strategy.name=zero3")


def test_cpu_offload_needs_gpu_workers():
    """FSDP2's CPU offload moves parameters between host and GPU memory: on CPU workers it has nowhere to go."""
    with pytest.raises(ValueError, match=r"strategy\.offload=true needs scaling\.use_gpu=true"):
        load_job_config(None, ["strategy.name=zero3", "strategy.offload=true"])
    config = load_job_config(None, ["strategy.name=zero2", "strategy.offload=true", "scaling.use_gpu=true"])
    assert config.strategy.offload


def test_math_hash_same_for_int_and_float_spelling():
    assert JobConfig(optim=OptimConfig(weight_decay=0, lr=1)).math_hash() == \
        JobConfig(optim=OptimConfig(weight_decay=0.0, lr=1.0)).math_hash()


# -- workloads.resolve_workload_class ---------------------------------------------------------------------


@pytest.mark.parametrize(("name", "fragments"), [
    pytest.param("nope.mod:Thing", ["workload.name='nope.mod:Thing'", "cannot import module 'nope.mod'",
                                    "pkg.module:ClassName"], id="unknown-module"),
    pytest.param("raylastic.workloads.digits:Nope",
                 ["workload.name='raylastic.workloads.digits:Nope'", "has no class 'Nope'"],
                 id="missing-class"),
    pytest.param("raylastic.workloads:BUILTIN_WORKLOADS", ["has no class 'BUILTIN_WORKLOADS'"], id="not-a-class"),
    pytest.param("collections:OrderedDict", ["OrderedDict lacks build_model, train_dataset, training_step",
                                             "workloads/protocol.py"], id="missing-methods"),
    pytest.param("nope", ["workload.name='nope' is not", *BUILTIN_WORKLOADS, "'pkg.module:ClassName'"],
                 id="not-a-path"),
    pytest.param("raylastic.workloads.digits:", ["is not"], id="no-class-part"),
    pytest.param(":Digits", ["is not"], id="no-module-part"),
])
def test_resolve_workload_class_errors(name, fragments):
    with pytest.raises(ValueError) as raised:
        resolve_workload_class(name)
    for fragment in fragments:
        assert fragment in str(raised.value), f"{fragment!r} not in {str(raised.value)!r}"


@pytest.mark.parametrize("name", ["digits", "raylastic.workloads.digits:Digits"])
def test_resolve_workload_class_finds_builtin_and_path(name):
    assert resolve_workload_class(name) is Digits


@pytest.mark.processes
def test_jobconfig_imports_no_other_layer():
    """Every layer imports jobconfig and it imports none of them, so no dependency points outward."""
    layers = {"cluster", "actors", "strategies", "tuning", "workloads"}
    code = ("import sys, raylastic.jobconfig, raylastic.jobconfig.naming; "
            f"print(sorted({{m.split('.')[1] for m in sys.modules if m.startswith('raylastic.')}} & {layers}))")
    imported = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                              capture_output=True, text=True, check=True).stdout.strip()
    assert imported == "[]"


def test_actor_names_carry_the_run_name():
    assert controller_name("digits") == "raylastic:digits:controller"
    assert worker_name("digits", 3) == "raylastic:digits:worker3"
    assert slot_name("digits", 1) == "raylastic:digits:slot1"
    assert all(name.startswith(run_prefix("digits")) for name in (controller_name("digits"), worker_name("digits", 1)))
    assert not controller_name("digits-2").startswith(run_prefix("digits"))
    assert run_of_controller(controller_name("my-run_1")) == "my-run_1"
    assert run_of_controller(worker_name("digits", 1)) is None
