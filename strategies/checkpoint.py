"""Checkpoints (format v0): rank 0 writes the full state; a JSON manifest, written last, marks it complete.

Layout: ``<root>/step_00000120/{state.pt, manifest.json}``. The manifest is written to a
temporary file, fsynced and renamed, so a directory without one (a crash mid-save) is never
loaded. ``state.pt`` holds only tensors and plain containers: it loads with
``torch.load(..., weights_only=True)``. Old checkpoints are removed only after a newer one is
complete. (The sharded, resharding format replaces the state file in a later version; the
manifest keeps its shape.)
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

MANIFEST_NAME = "manifest.json"
STATE_NAME = "state.pt"
FORMAT = "full-v0"


@dataclass(frozen=True, kw_only=True)
class CheckpointManifest:
    step: int
    """Optimizer steps committed in this state; training resumes at the next one."""
    world_size: int
    samples_consumed: int
    """The data cursor: position in the global sample stream (step * global_batch_size)."""
    config_hash: str
    format: str = FORMAT
    created_at: float = 0.0


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    manifest: CheckpointManifest


@dataclass(frozen=True, kw_only=True)
class Checkpointer:
    """Where and how often rank 0 saves, and how many complete checkpoints it keeps."""

    root: str
    every_steps: int
    num_to_keep: int
    config_hash: str
    global_batch_size: int

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def save(self, step: int, world_size: int, state: Callable[[], dict[str, Any]]) -> Path:
        """Write ``state()`` for ``step`` and its manifest last; then prune older checkpoints."""
        manifest = CheckpointManifest(step=step, world_size=world_size,
                                      samples_consumed=step * self.global_batch_size,
                                      config_hash=self.config_hash, created_at=time.time())
        path = write_checkpoint(Path(self.root), manifest, state())
        prune_checkpoints(Path(self.root), self.num_to_keep)
        return path


def write_checkpoint(root: Path, manifest: CheckpointManifest, state: dict[str, Any]) -> Path:
    directory = root / f"step_{manifest.step:08d}"
    if directory.exists():  # an incomplete earlier attempt at this step, or a save we redo
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    torch.save(state, directory / STATE_NAME)
    _fsync(directory / STATE_NAME)
    _write_atomically(directory / MANIFEST_NAME, json.dumps(asdict(manifest), indent=2))
    return directory


def complete_checkpoints(root: str | Path) -> list[Checkpoint]:
    """Checkpoints under ``root`` with a valid manifest, oldest first."""
    found = []
    for directory in sorted(Path(root).glob("step_*")):
        manifest = read_manifest(directory)
        if manifest is not None and (directory / STATE_NAME).is_file():
            found.append(Checkpoint(directory, manifest))
    return sorted(found, key=lambda c: c.manifest.step)


def latest_checkpoint(root: str | Path) -> Checkpoint | None:
    checkpoints = complete_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def read_manifest(directory: Path) -> CheckpointManifest | None:
    try:
        return CheckpointManifest(**json.loads((directory / MANIFEST_NAME).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def load_checkpoint_state(path: str | Path) -> dict[str, Any]:
    """The saved state (model, optimizer, step), without unpickling arbitrary objects."""
    return torch.load(Path(path) / STATE_NAME, map_location="cpu", weights_only=True)


def prune_checkpoints(root: Path, num_to_keep: int) -> None:
    """Remove the oldest complete checkpoints beyond ``num_to_keep`` and any incomplete older ones."""
    complete = complete_checkpoints(root)
    keep = {c.path for c in complete[-num_to_keep:]}
    newest_step = complete[-1].manifest.step if complete else -1
    for directory in root.glob("step_*"):
        older = int(directory.name.removeprefix("step_")) < newest_step
        if directory not in keep and older:
            shutil.rmtree(directory, ignore_errors=True)


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_directory(path.parent)


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
