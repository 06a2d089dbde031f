"""The device check: every GPU test this machine allows, in one command, and a table of what passed.

    python -m benchmarks.device_check                          # on a GPU machine, from the repository root
    python -m benchmarks.device_check --out /tmp/check.json    # the JSON elsewhere
    python -m benchmarks.device_check --budget-s 900           # more time (default 480 s)

It installs nothing and fetches nothing: the tests run from this checkout (it is put first on PYTHONPATH, and
``raylastic`` finds its subpackages beside it), with whatever torch, Python and pytest the machine has; torch is
never installed. Two groups, one pytest process each:

- ``torch``: tests/test_gpu_torch.py, which needs only torch.distributed (NCCL groups of processes started by
  torch.multiprocessing). It runs with Ray hidden (a ``ray`` that fails to import comes first on the path), so
  it proves this group runs where Ray is missing;
- ``ray``: every test marked ``gpu`` under ``tests/`` (or the paths given): tests/test_gpu.py's Ray runs and the
  GPU tests of the other modules. Where Ray is not importable, the modules that import it are listed as not run.

Each test is one row: its group, name, ranks (GPUs), seconds and outcome. A test that would start after the
group's share of ``--budget-s`` is not run (the table says so); a group's pytest still running 60 s after its
deadline is stopped. The versions it ran with (Python, torch, CUDA, NCCL, driver, GPUs, Ray, pytest, the commit),
every row and the summary go to a JSON file (default benchmarks/results/device_check/device_check.json), each
group's pytest output beside it (``.torch.log``, ``.ray.log``). Exit status: 0 clean (skips allowed), 1 a
failure, 2 some tests did not run. What it covers and what has run where: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks._device_check_plugin import DEADLINE, EVENTS
from benchmarks._device_check_report import RAY_MISSING, Row, exit_code, format_summary, format_table, rows_of

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "device_check" / "device_check.json"
"""In a folder of its own: benchmarks/report.py renders every JSON directly under benchmarks/results/."""
TORCH_SHARE = 0.45
"""The torch group's share of the budget; the Ray group has what is left."""
GRACE_S = 60.0
"""How long past its deadline a group's pytest may finish the test it is in before it is stopped."""
HIDDEN_RAY = 'raise ImportError("Ray is hidden by the device check: this group must run without it")\n'


@dataclass(frozen=True)
class Group:
    """One pytest run of the check."""

    name: str
    pytest_args: tuple[str, ...]
    hide_ray: bool
    """Put a ``ray`` that fails to import first on the path of its processes."""


def check_groups(paths: tuple[str, ...]) -> tuple[Group, Group]:
    """The torch group, then the ray group, which looks for ``gpu`` tests under ``paths``."""
    return (Group("torch", ("tests/test_gpu_torch.py",), hide_ray=True),
            Group("ray", ("-m", "gpu", "--continue-on-collection-errors", "--ignore=tests/test_gpu_torch.py",
                          *paths), hide_ray=False))


@dataclass(frozen=True)
class GroupRun:
    """How a group's pytest ended."""

    name: str
    command: list[str]
    returncode: int | None
    """None: stopped at its deadline."""
    seconds: float
    log: str


def run_group(group: Group, deadline: float, log: Path, events: Path) -> GroupRun:
    """``group``'s pytest, skipping tests that would start after ``deadline`` (time.time()), stopped GRACE_S
    after it; its output to ``log``, its events (benchmarks/_device_check_plugin.py) to ``events``."""
    command = [sys.executable, "-m", "pytest", "-p", "benchmarks._device_check_plugin", "-p", "no:cacheprovider",
               "-q", *group.pytest_args]
    with tempfile.TemporaryDirectory(prefix="device-check-") as hidden:
        if group.hide_ray:
            Path(hidden, "ray").mkdir()
            Path(hidden, "ray", "__init__.py").write_text(HIDDEN_RAY)
        env = {**os.environ, "PYTHONPATH": _python_path(*([hidden] if group.hide_ray else [])), EVENTS: str(events),
               DEADLINE: str(deadline)}
        started = time.monotonic()
        with open(log, "w") as output:
            process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            try:
                returncode: int | None = process.wait(timeout=max(1.0, deadline - time.time() + GRACE_S))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # its process group: the ranks it started too
                process.wait(timeout=60)
                returncode = None
    return GroupRun(group.name, command, returncode, round(time.monotonic() - started, 1), str(log))


def _python_path(*first: str) -> str:
    """``first``, then this checkout (so its ``raylastic`` is the one imported, installed or not), then the
    caller's PYTHONPATH."""
    return os.pathsep.join([*first, str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def machine_versions() -> dict:
    """benchmarks/_device_check_versions.py's answer, from a process of its own (none on failure: its error)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks._device_check_versions"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": _python_path()})
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-2000:]}
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["tests"], help="where the ray group looks for `gpu` tests")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON file written")
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole check's time")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        raise SystemExit(f"--budget-s must be positive, got {args.budget_s}")
    started = time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    versions = machine_versions()
    print("versions:", json.dumps(versions, indent=1))
    if not versions.get("cuda_available"):
        print("torch sees no CUDA device here: every GPU test skips")
    ray_missing = importlib.util.find_spec("ray") is None
    rows: list[Row] = []
    runs: list[GroupRun] = []
    for group in check_groups(tuple(args.paths)):
        share = TORCH_SHARE if group.name == "torch" else 1.0
        deadline = started + share * args.budget_s
        events = args.out.with_suffix(f".{group.name}.events")
        events.unlink(missing_ok=True)
        print(f"running the {group.name} group ...", flush=True)
        run = run_group(group, deadline, args.out.with_suffix(f".{group.name}.log"), events)
        runs.append(run)
        rows += rows_of(group.name, read_events(events), ended_early=run.returncode is None,
                        not_collected_reason=RAY_MISSING if ray_missing and not group.hide_ray else None)
        events.unlink(missing_ok=True)
    print(format_table(rows))
    print(format_summary(rows))
    status = exit_code(rows)
    args.out.write_text(json.dumps({
        "versions": versions, "budget_s": args.budget_s, "wall_s": round(time.time() - started, 1),
        "exit_status": status, "summary": format_summary(rows),
        "groups": [dataclasses.asdict(run) for run in runs], "tests": [dataclasses.asdict(row) for row in rows]},
        indent=1) + "\n")
    print(f"written: {args.out}; pytest's output: {', '.join(run.log for run in runs)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
