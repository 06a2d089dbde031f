"""The ``raylastic`` command on bad configs: one ``error: ...`` line naming the field, exit code 2, no traceback.

Every case fails before Ray starts. To keep it so, the command runs as ``python -m raylastic`` under a guard
that turns any ``ray.init`` into exit code 99 (so a regression fails here instead of starting Ray). One
test runs a real 3-step job with the ``raylastic`` script, from the directory that holds its workload.

    python -m pytest tests/test_cli.py -q
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

REPO_ROOT = Path(__file__).resolve().parent.parent
RAY_INIT_EXIT_CODE = 99
TORCH_NOT_IMPORTED = "test guard: torch was not imported"
# Equivalent to `python -m raylastic ARGS`, with ray.init replaced by an exit; it says at exit whether torch was
# imported (a bad config is reported in a fraction of a second, before torch's ~2 s import).
GUARDED_MAIN = f"""
import atexit, runpy, sys
atexit.register(lambda: "torch" in sys.modules or sys.stderr.write("\\n{TORCH_NOT_IMPORTED}\\n"))
import ray
def _refuse(*args, **kwargs):
    sys.stderr.write("test guard: ray.init was reached\\n")
    raise SystemExit({RAY_INIT_EXIT_CODE})
ray.init = _refuse
runpy.run_module("raylastic", run_name="__main__", alter_sys=True)
"""
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["CI"] = "true"
    return env


def _start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        stderr += "\ntimed out after 60 s"
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _console_script() -> str | None:
    return shutil.which("raylastic", path=str(Path(sys.executable).parent)) or shutil.which("raylastic")


BAD_CONFIGS = [
    pytest.param(["--set", "training.stepz=3"], ["unknown key training.stepz", "steps"], id="unknown-key"),
    pytest.param(["--set", "scaling.min_workers=3", "--set", "scaling.max_workers=2"],
                 ["scaling.min_workers (3)", "scaling.max_workers (2)"], id="min-above-max"),
    pytest.param(["--set", "workload.name=nope.mod:Thing"], ["workload.name='nope.mod:Thing'", "nope.mod"],
                 id="bad-workload-path"),
    pytest.param(["--config", "no/such/job.yaml"], ["--config no/such/job.yaml", "cannot read"],
                 id="missing-config-file"),
    pytest.param(["--set", "training.steps"], ["--set 'training.steps'", "section.field=value"],
                 id="override-without-equals"),
    pytest.param(["--set", "training.steps=[1"], ["training.steps"], id="unparsable-value"),
    pytest.param(["--set", "training=0"], ["training", "mapping"], id="falsy-section-value"),
]
HELP_COMMANDS = {"top": ["--help"], "train": ["train", "--help"]}


@pytest.fixture(scope="module")
def finished() -> dict[str, subprocess.CompletedProcess]:
    """Every command of this module, started at once (each imports Ray, ~0.5 s, for the guard)."""
    started = {case.id: _start([sys.executable, "-c", GUARDED_MAIN, "train", *case.values[0]])
               for case in BAD_CONFIGS}
    started["sweep-unknown-key"] = _start([sys.executable, "-c", GUARDED_MAIN, "sweep", "--set", "training.stepz=3"])
    script = _console_script()
    if script is not None:
        started.update({f"help-{key}": _start([script, *args]) for key, args in HELP_COMMANDS.items()})
    return {key: _finish(process) for key, process in started.items()}


@pytest.mark.parametrize(("args", "fragments"), BAD_CONFIGS)
def test_bad_config_prints_one_error_and_exits_2(finished, request, args, fragments):
    completed = finished[request.node.callspec.id]
    stderr = ANSI_ESCAPE.sub("", completed.stderr)
    assert completed.returncode != RAY_INIT_EXIT_CODE, f"reached ray.init with a bad config: {args}"
    assert "Traceback" not in stderr + completed.stdout, stderr
    assert completed.returncode == 2, (completed.returncode, stderr)
    assert stderr.startswith("error: "), stderr
    assert TORCH_NOT_IMPORTED in stderr
    for fragment in fragments:
        assert fragment in stderr, f"{fragment!r} not in {stderr!r}"


def test_sweep_reports_a_bad_base_job_before_importing_ray_tune_or_torch(finished):
    completed = finished["sweep-unknown-key"]
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr.startswith("error: unknown key training.stepz") and TORCH_NOT_IMPORTED in completed.stderr


def _help(finished: dict[str, subprocess.CompletedProcess], key: str) -> str:
    if f"help-{key}" not in finished:
        pytest.skip("the raylastic console script is not installed (pip install -e .)")
    completed = finished[f"help-{key}"]
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def test_top_level_help_lists_train(finished):
    stdout = _help(finished, "top")
    assert "usage: raylastic" in stdout and "train" in stdout


def test_console_script_names_a_broken_workload_module_of_the_working_directory_before_ray_starts(tmp_path):
    """``raylastic train`` run where the user's module is imports it from there (a module that imports is trained
    from there: test_cluster_submit's laptop-mode run)."""
    script = _console_script()
    if script is None:
        pytest.skip("the raylastic console script is not installed (pip install -e .)")
    (tmp_path / "broken_workload.py").write_text("raise RuntimeError('no data here')\n")
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    broken = subprocess.run([script, "train", "--set", "workload.name=broken_workload:W"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    stderr = ANSI_ESCAPE.sub("", broken.stderr)
    assert broken.returncode == 2 and "Traceback" not in stderr, stderr
    assert stderr.startswith("error: workload.name='broken_workload:W': importing module 'broken_workload' raised "
                             "RuntimeError: no data here"), stderr


def test_train_and_sweep_take_the_same_job_arguments():
    from raylastic.cluster.cli import build_parser

    for command, config_flag in (("train", "--config"), ("sweep", "--base")):
        args = build_parser().parse_args([command, config_flag, "job.yaml", "--set", "training.steps=5", "--set",
                                          "optim.lr=0.01", "--address", "auto"])
        assert (args.config, args.overrides, args.address) == ("job.yaml", ["training.steps=5", "optim.lr=0.01"],
                                                                "auto"), command


def test_train_help_lists_every_option(finished):
    stdout = _help(finished, "train")
    for option in ("--set", "--address", "--run-dir", "--config"):
        assert option in stdout
