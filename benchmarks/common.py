"""What every benchmark shares: where results go, what the machine and the code were, writing JSON and plots.

    from benchmarks.common import RESULTS, alternated, code_version, machine_info, save_figure, write_json

    for side in alternated(["ours", "peer"], round_index): ...

    payload = {"machine": machine_info(), "code": code_version(), ...}
    write_json("throughput", payload)          # benchmarks/results/throughput.json
    save_figure(fig, RESULTS / "throughput.png")
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"


def machine_info() -> dict[str, Any]:
    """The machine, its load, the versions and the command: these benchmarks share their cores with whatever else
    runs, so every result carries them."""
    import ray
    import torch

    return {"cpu_count": os.cpu_count(), "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(), "processor": platform.processor() or _cpu_model(),
            "python": platform.python_version(),
            "torch": torch.__version__, "ray": ray.__version__,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": _git("describe", "--always",
                                                                                           "--dirty"),
            "command": shlex.join(["python", "-m", f"benchmarks.{Path(sys.argv[0]).stem}", *sys.argv[1:]])}


def _cpu_model() -> str:
    """The CPU's model name and whether it computes bf16 natively (Linux /proc/cpuinfo; "" elsewhere): bf16 autocast
    runs several times slower where it does not."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    return f"{model}{', AVX512-BF16' if 'avx512_bf16' in text else ', no AVX512-BF16' if model else ''}"


def code_version() -> str:
    """The commit measured, and whether the tree differs from it (``git status --porcelain`` lines)."""
    changed = (_git("status", "--porcelain") or "").splitlines()
    return f"{_git('rev-parse', '--short', 'HEAD') or 'unknown'} + {len(changed)} changed/untracked paths: " \
           f"{', '.join(changed)[:300]}"


def _git(*args: str) -> str | None:
    done = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def write_json(stem: str, payload: dict[str, Any]) -> Path:
    """``payload`` as benchmarks/results/<stem>.json; returns the path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{stem}.json"
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return path


def save_figure(fig: Any, path: Path, *, dpi: int = 120) -> None:
    """Write a matplotlib figure and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def guarded(measure: Any, *args: Any, **kwargs: Any) -> dict:
    """One measurement; an error is recorded (this machine is shared, the code under test moves) and the rest go on."""
    try:
        return measure(*args, **kwargs)
    except Exception as error:  # noqa: BLE001
        return {"status": "error", "error": f"{type(error).__name__}: {str(error)[:400]}"}


def local_ray(num_cpus: int, *, ours: bool = True) -> None:
    """A local Ray instance; ours: the job's runtime environment as ``raylastic train`` sets it (the setup hook
    that imports our modules), otherwise as a Ray Train user's job has it."""
    from raylastic.cluster.connect import job_runtime_env
    from raylastic.cluster.local_start import start_local_ray
    from raylastic.jobconfig.naming import NAMESPACE

    runtime_env = job_runtime_env(str(REPO_ROOT)) if ours else {"env_vars": {"PYTHONPATH": str(REPO_ROOT)}}
    start_local_ray(num_cpus=num_cpus, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False,
                    logging_level=logging.WARNING, runtime_env=runtime_env)


def alternated(sides: Sequence[T], round_index: int) -> list[T]:
    """``sides`` in round ``round_index``'s order: reversed every other round, so that drift in the machine's load
    over a benchmark falls on every side alike."""
    return list(sides) if round_index % 2 == 0 else list(reversed(sides))


def numbers(run: dict) -> dict[str, float]:
    """A run's numeric figures, its ``breakdown``'s among them, for medians over rounds."""
    flat = {**run, **run.get("breakdown", {})}
    return {k: v for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
