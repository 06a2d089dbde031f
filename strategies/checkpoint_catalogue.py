"""The checkpoints of a run as the Controller sees them: where they are, which are complete, which may be
loaded, which to prune. Reads manifests and lists directories, never loads state, and imports no torch (only
checking a checkpoint's DCP ``.metadata`` does: strategies/checkpoint_manifest.py).

Example::

    checkpoint, rejected = newest_complete("runs/x/checkpoints")   # files checked by their sizes
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass

from raylastic.strategies.checkpoint_manifest import (
    CheckpointManifest,
    filesystem,
    read_manifest,
    verify,
    written_by_us,
)


@dataclass(frozen=True)
class Checkpoint:
    path: str
    manifest: CheckpointManifest


@dataclass(frozen=True)
class Rejected:
    path: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class CheckpointSettings:
    """Where and how often the group saves, and how many complete checkpoints it keeps (the saving itself:
    strategies/checkpoint.py's ``Checkpointer``)."""

    root: str
    every_steps: int
    num_to_keep: int
    config_hash: str
    global_batch_size: int
    async_save: bool = False
    step_multiple: int = 1
    """Every checkpoint's step is a multiple of this (strategy.sync_every under diloco: only after an outer step
    do the ranks hold the same parameters)."""

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def may_save_at(self, step: int) -> bool:
        """Whether a checkpoint asked for at any time (a time-based one) may be taken after ``step``."""
        return step % self.step_multiple == 0

    def directory(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/step_{step:08d}"

def complete_checkpoints(root: str | os.PathLike) -> list[Checkpoint]:
    """Checkpoints under ``root`` with a manifest, oldest first (not yet verified)."""
    fs, path = filesystem(root)
    if not fs.exists(path):
        return []
    found = []
    for directory in fs.ls(path, detail=False):
        if step_of(directory) is not None:
            manifest = read_manifest(same_scheme(root, directory))
            if manifest is not None:
                found.append(Checkpoint(same_scheme(root, directory), manifest))
    return sorted(found, key=lambda c: c.manifest.step)


def newest_loadable(root: str | os.PathLike, max_step: int | None = None) -> tuple[Checkpoint | None, list[Rejected]]:
    """The newest complete checkpoint (of at most ``max_step``) whose files are intact, and the newer ones
    rejected on the way."""
    rejected = []
    for checkpoint in reversed(complete_checkpoints(root)):
        if max_step is not None and checkpoint.manifest.step > max_step:
            continue
        reason = verify(checkpoint.path, checkpoint.manifest)
        if reason is None:
            return checkpoint, rejected
        rejected.append(Rejected(checkpoint.path, reason))
    return None, rejected


def latest_checkpoint(root: str | os.PathLike) -> Checkpoint | None:
    return newest_loadable(root)[0]


def newest_complete(root: str | os.PathLike, max_step: int | None = None, skip: Collection[str] = ()
                    ) -> tuple[Checkpoint | None, list[Rejected]]:
    """As ``newest_loadable``, but its files are checked by their sizes only, none read (DCP's metadata neither):
    what the head node may check of a checkpoint on shared storage. The ranks that load it compare the checksums
    and read the metadata (``verify_for_load``). ``skip``: checkpoints already refused."""
    rejected = []
    for checkpoint in reversed(complete_checkpoints(root)):
        if (max_step is not None and checkpoint.manifest.step > max_step) or checkpoint.path in skip:
            continue
        reason = verify(checkpoint.path, checkpoint.manifest, checksummed=(), metadata=False)
        if reason is None:
            return checkpoint, rejected
        rejected.append(Rejected(checkpoint.path, reason))
    return None, rejected


def prune_checkpoints(root: str, num_to_keep: int, *, written_step: int) -> None:
    """Once the checkpoint of ``written_step`` is complete: remove older complete checkpoints beyond the
    newest ``num_to_keep`` up to it, and older incomplete directories that we wrote (``written_by_us``); a complete
    checkpoint's step is its manifest's, both to keep and to delete, an incomplete one's its directory's name. A
    higher step (an earlier life of the run that got further, say) is left alone: the checkpoint just written
    does not supersede it. So is every directory we did not write, whatever its name."""
    found = complete_checkpoints(root)
    keep = {c.path for c in [c for c in found if c.manifest.step <= written_step][-num_to_keep:]}
    manifest_steps = {c.path: c.manifest.step for c in found}
    fs, path = filesystem(root)
    for listed in fs.ls(path, detail=False):
        directory = same_scheme(root, listed)
        step = manifest_steps.get(directory, step_of(listed))
        if step is not None and step < written_step and directory not in keep and written_by_us(directory):
            fs.rm(listed, recursive=True)


def same_scheme(root: str, path: str) -> str:
    """``path`` as listed by fsspec, written with ``root``'s protocol prefix (if any)."""
    protocol, sep, _ = str(root).partition("://")
    if not sep:
        return path
    return path if "://" in path else f"{protocol}://{path}"


def step_of(directory: str) -> int | None:
    name = directory.rstrip("/").rsplit("/", 1)[-1]
    digits = name.removeprefix("step_")
    return int(digits) if name.startswith("step_") and digits.isdigit() else None
