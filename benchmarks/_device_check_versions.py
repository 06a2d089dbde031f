"""What the device check ran with: Python, torch, CUDA, NCCL, the driver, the GPUs, Ray (if installed), pytest,
and this checkout's commit. Run as a module it prints them as JSON (the check runs it in a process of its own,
so that its own process holds no CUDA context while the tests run)::

    python -m benchmarks._device_check_versions
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def _distribution(name: str) -> str | None:
    """An installed distribution's version, without importing it (Ray takes seconds; it may be broken)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _output(command: list[str], cwd: Path | None = None) -> str | None:
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _nccl(torch: Any) -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CPU build of torch has no NCCL to ask
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def versions() -> dict[str, Any]:
    """The versions of everything the GPU tests depend on; None where a part is missing."""
    import torch

    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())] if cuda else []
    drivers = _output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    status = _output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT)
    return {
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
        "nccl": _nccl(torch) if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "driver": sorted(set(drivers.splitlines()))[0] if drivers else None,
        "gpu_count": len(gpus), "gpus": gpus,
        "ray": _distribution("ray"), "pytest": _distribution("pytest"),
        "commit": _output(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT),
        "uncommitted_changes": bool(status) if status is not None else None,
    }


if __name__ == "__main__":
    print(json.dumps(versions()))
