"""The two sides of a training benchmark: our job through ``raylastic.train`` on the Ray this process is
connected to, and the same job run by torchrun with plain DDP (benchmarks/_torchrun_ddp.py); each measured in
steady state (after WARMUP_FRACTION of the steps) with the CPU seconds of its processes. The GPT case's model,
recipe and tokens are here too, for every benchmark that trains it.

    sections = job_sections("gpt", steps=300, global_batch_size=32, scratch=scratch)
    ours = measure_ours(job_config_from_dict({**sections, "name": "gpt"}), run_dir).measurement
    peer = run_torchrun(sections, peer_dir)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks._cpu_meter import CpuMeter, Measurement, descendants
from benchmarks.common import REPO_ROOT
from raylastic.actors.status.run import RunResult
from raylastic.cluster.job import train
from raylastic.jobconfig import JobConfig, job_config_from_dict
from raylastic.workloads.tokens import prepare_corpus, stdlib_corpus_files

PEER_SCRIPT = REPO_ROOT / "benchmarks" / "_torchrun_ddp.py"
NUM_WORKERS = 2
WARMUP_FRACTION = 0.2
PEER_EXIT_GRACE_S = 30.0
GPT_CORPUS_FILES = 110
"""The first 110 files of workloads.tokens.stdlib_corpus_files(): ~2 MB, ~1.8 M train tokens, tokenized in ~1 s."""
GPT_MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 64, "dropout": 0.1, "eval_blocks": 64}
GPT_RECIPE = {"lr": 1e-3, "schedule": "cosine", "warmup_steps": 30, "min_lr": 1e-4, "clip_grad_norm": 1.0}
GPT_PRECISION = "bf16"
"""bf16 autocast: 0.51-0.68x the fp32 step time of this model on this CPU (AVX512-BF16, no AMX)."""
@dataclass(frozen=True)
class SteadyState:
    """The measured part of a run: from the commit of the last warm-up step to the commit of the last step."""

    first_s: float
    last_s: float
    steps: int

    @classmethod
    def of(cls, commit_times_s: list[float]) -> SteadyState:
        first = max(1, int(len(commit_times_s) * WARMUP_FRACTION)) - 1
        if len(commit_times_s) - 1 - first < 1:
            raise ValueError(f"need more steps to measure a steady state, got {len(commit_times_s)}")
        return cls(commit_times_s[first], commit_times_s[-1], len(commit_times_s) - 1 - first)

    def samples_per_s(self, global_batch_size: int) -> float:
        return self.steps * global_batch_size / (self.last_s - self.first_s)

    def window(self, origin: float | None) -> tuple[float, float] | None:
        """The window as time.time() values, when the commit times count from time.time() ``origin``."""
        return None if origin is None else (origin + self.first_s, origin + self.last_s)


def job_sections(workload: str, steps: int, global_batch_size: int, scratch: Path,
                 num_workers: int = NUM_WORKERS) -> dict:
    """The job config both sides run (ours as a JobConfig, torchrun's peer reads it as JSON)."""
    sections = {"workload": {"name": workload},
                "training": {"steps": steps, "global_batch_size": global_batch_size},
                "scaling": {"min_workers": num_workers, "max_workers": num_workers, "cpus_per_worker": 1},
                "checkpoint": {"every_steps": 0, "resume": "never"}}
    if workload == "gpt":
        sections["workload"]["options"] = {"data_dir": str(gpt_token_dir(scratch)), **GPT_MODEL}
        sections["optim"] = dict(GPT_RECIPE)
        sections["training"]["precision"] = GPT_PRECISION
    job_config_from_dict(sections)  # a bad section fails here, before either side starts
    return sections


def gpt_token_dir(scratch: Path) -> Path:
    """train.bin/val.bin/meta.json of the gpt case, made once per benchmark run."""
    token_dir = scratch / "gpt-tokens"
    if not (token_dir / "meta.json").is_file():
        prepare_corpus(stdlib_corpus_files()[:GPT_CORPUS_FILES], token_dir)
    return token_dir


@dataclass(frozen=True)
class OursRun:
    measurement: Measurement
    result: RunResult
    """The run's history and events (benchmarks/balance.py reads the shares and compute times)."""


def measure_ours(job: JobConfig, run_dir: Path) -> OursRun:
    """Train ``job`` on the Ray this process is connected to; its steady-state samples/s and CPU use."""
    origins: list[float] = []  # when the run log started: an event's arrival less its time_s (~ms late)

    def follow(progress: dict) -> None:
        origins.extend(time.time() - event.time_s for event in progress.events)

    started, cpu = time.perf_counter(), CpuMeter(rank_marker="ray::TrainWorker")
    result = train(job, run_dir=run_dir, on_progress=follow)
    wall_s = time.perf_counter() - started
    steps = job.training.steps
    assert [row["step"] for row in result.history] == list(range(1, steps + 1)), "a step was redone or lost"
    steady = SteadyState.of([row["time_s"] for row in result.history])  # rank 0's wall clock at each commit
    return OursRun(cpu.measurement(steady.samples_per_s(job.training.global_batch_size), wall_s,
                                   steady.window(min(origins, default=None)), steady.steps), result)


def run_torchrun(sections: dict, run_dir: Path, num_workers: int = NUM_WORKERS,
                 peer_options: Sequence[str] = (), peer_env: Mapping[str, str] | None = None,
                 script: Path = PEER_SCRIPT) -> Measurement:
    """The peer ``script`` (benchmarks/_torchrun_ddp.py) on ``num_workers`` ranks; ``peer_options``: more of its
    options; ``peer_env``: more environment for its ranks."""
    out, job_file = run_dir / "peer.json", run_dir / "job.json"
    job_file.write_text(json.dumps(sections))
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
               str(num_workers), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               str(script), "--job", str(job_file), "--out", str(out), *peer_options]
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **(peer_env or {}), "PYTHONPATH": python_path}
    cpu = CpuMeter(rank_marker=script.name)
    wall_s = _run_peer(command, env, out)
    report = json.loads(out.read_text())
    steady = SteadyState.of(report["step_times_s"])
    return cpu.measurement(steady.samples_per_s(sections["training"]["global_batch_size"]), wall_s,
                           steady.window(report["started_unix_s"]), steady.steps)


def _run_peer(command: list[str], env: dict[str, str], out: Path) -> float:
    """Run torchrun; its wall time. Once rank 0 has written ``out``, torchrun gets PEER_EXIT_GRACE_S to exit
    and is then killed (with its ranks): a gloo teardown hung at exit once, its other rank gone."""
    stderr_path = out.with_suffix(".stderr")
    started, reported_at = time.perf_counter(), None
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                   start_new_session=True)
        while process.poll() is None:
            time.sleep(0.2)
            if reported_at is None and out.exists():
                reported_at = time.perf_counter()
            elif reported_at is not None and time.perf_counter() - reported_at > PEER_EXIT_GRACE_S:
                for pid in descendants(process.pid):  # torchrun starts each rank in a session of its own
                    os.kill(pid, signal.SIGKILL)
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                print(f"  warning: torchrun did not exit {PEER_EXIT_GRACE_S:.0f}s after its report; killed it "
                      "(the report was complete; the run's wall time ends at the report)", flush=True)
                return reported_at - started
    if process.returncode != 0:
        raise RuntimeError(f"torchrun peer failed ({process.returncode}):\n{stderr_path.read_text()[-3000:]}")
    return time.perf_counter() - started


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
