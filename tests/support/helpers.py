"""Small helpers shared by the tests."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group_table

from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.status.run import Event, RunStatus
from raylastic.jobconfig import load_job_config
from raylastic.jobconfig.naming import slot_name
from raylastic.workloads.tokens import prepare_corpus, stdlib_corpus_files
from tests.support.ray_head import process_start_time


def job(*overrides: str, name: str = "t"):
    """A short job config: the given ``--set`` style overrides over small, fast defaults."""
    base = [f"name={name}", "training.steps=20", "training.global_batch_size=48", "scaling.cpus_per_worker=0.5",
            "failure.collective_timeout_s=20"]
    return load_job_config(None, base + list(overrides))


def step_indices(order: GlobalSampleOrder, step: int) -> torch.Tensor:
    """Dataset indices of the whole global batch of ``step`` (0-based), in stream order: what a single
    process training on the whole batch takes."""
    return order.rank_indices(step, rank=0, world_size=1)


def run_status(history: list[dict], events: list[dict] = (), evaluations: list[dict] = ()) -> RunStatus:
    """A ``Controller.progress()`` answer with these rows, events (as result.json holds them) and evaluations."""
    return RunStatus(state="running", generation=0, world_size=2, step=history[-1]["step"] if history else 0,
                     members=[], failures=0, history=list(history), events=[Event.from_dict(e) for e in events],
                     evaluations=list(evaluations))


def sigkill_ranks_once(step: int, ranks: tuple[int, ...]) -> tuple[Callable[[RunStatus], None], dict[str, Any]]:
    """An on_progress callback that SIGKILLs the workers of ``ranks`` from outside, together, once generation 0
    has committed ``step`` steps; returns it and what it did (the workers, the step it saw)."""
    done: dict[str, Any] = {}

    def on_progress(progress: RunStatus) -> None:
        if done or progress.generation != 0 or progress.step < step:
            return
        names = [progress.members[rank] for rank in ranks]
        pids = ray.get([ray.get_actor(name).pid.remote() for name in names])
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        done.update(workers=names, step=progress.step)

    return on_progress, done


class StoppedProcess:
    """A process this test SIGSTOPped. Continued or killed later only while its pid still names it: a dead
    process's pid is soon reused (pid_max is 32768 here, and threads take ids too), and a signal sent to the
    reused one would hit another test's process."""

    def __init__(self, pid: int) -> None:
        self.pid, self.started = pid, process_start_time(pid)
        os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def end(self) -> None:
        """Continue and kill it, if it still runs."""
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.started is not None and process_start_time(self.pid) == self.started:
            os.kill(self.pid, signum)


def held_slots(run: str) -> list[str]:
    """The run's placement groups (``slot_name(run, n)``) that Ray still holds, with their states."""
    head = slot_name(run, 0).removesuffix("0")
    return sorted(f"{info['name']} {info['state']}" for info in placement_group_table().values()
                  if info["name"].startswith(head) and info["state"] != "REMOVED")


def strict_json(path: Path) -> dict:
    """``path`` parsed as standard JSON: a bare NaN or Infinity (which Python writes by default) fails."""
    def refuse(constant: str) -> None:
        raise AssertionError(f"{path} holds a bare {constant}, which is not JSON")

    return json.loads(Path(path).read_text(), parse_constant=refuse)


def load_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / "model.pt", weights_only=True)


# Parameters of runs whose gradients were summed in another order (another world size, other shards,
# another pipeline split) differ by float noise of ~1e-6; a step skipped or applied twice moves them by ~lr.
REORDERED_SUMS_ATOL = 1e-5


def assert_states_close(first: dict, second: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


def applied_samples(ledger: dict[int, list[dict]], steps: int, num_samples: int) -> dict[int, list[int]]:
    """Assert the run applied every step 1..``steps`` exactly once (one kept application each: see
    RunLog.ledger) and so consumed every sample once per epoch; returns each step's samples."""
    assert sorted(ledger) == list(range(1, steps + 1)), f"steps missing from the ledger: {sorted(ledger)}"
    applied = {}
    for step, applications in ledger.items():
        kept = [a for a in applications if a["kept"]]
        assert len(kept) == 1, f"step {step} applied {len(kept)} times: {applications}"
        applied[step] = kept[0]["samples"]
    stream = [i for step in range(1, steps + 1) for i in applied[step]]
    for start in range(0, len(stream), num_samples):
        epoch = stream[start:start + num_samples]
        expected = list(range(num_samples)) if len(epoch) == num_samples else sorted(set(epoch))
        assert sorted(epoch) == expected, f"epoch {start // num_samples}: a sample missed or consumed twice"
    return applied


def with_ctrl_c_enabled(command: list[str]) -> list[str]:
    """``command`` started with SIGINT at its default disposition, as Ctrl-C finds a program in a terminal.

    A test runner started in the background by a non-interactive shell (``cmd &``, as CI may run it)
    ignores SIGINT, and children inherit that: a SIGINT sent to them would be lost. ``command[0]``
    must be a path (``sys.executable``).
    """
    reset = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", reset, *command]


def wait_until_gone(actor_name: str, timeout_s: float = 30) -> None:
    """Wait until no actor is named ``actor_name`` (in the connected Ray); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(actor_name)
        except ValueError:
            return
        time.sleep(0.2)
    raise AssertionError(f"{actor_name} is still there after {timeout_s:.0f}s")


def wait_until_cpus_free(timeout_s: float = 60) -> None:
    """Wait until every CPU of the connected Ray cluster is free (the runs before have let go of theirs); fail
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, f"CPUs still taken after {timeout_s:.0f}s: {ray.available_resources()}"
        time.sleep(0.2)


def tokenized_stdlib(directory: Path, size_bytes: int) -> Path:
    """``raylastic tokenize --stdlib`` into ``directory``, cut to the leading files of about ``size_bytes``."""
    files, size = [], 0
    for path in stdlib_corpus_files():
        if size >= size_bytes:
            break
        files.append(path)
        size += path.stat().st_size
    prepare_corpus(files, directory)
    return directory
