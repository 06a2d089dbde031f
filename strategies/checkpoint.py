"""Sharded, resharding checkpoints: torch.distributed.checkpoint (DCP) plus a JSON manifest.

Layout: ``<root>/step_00000120/`` holds DCP's files (one or more per rank, written in parallel,
and DCP's ``.metadata``) and ``manifest.json``, written last by rank 0 once every rank's shard
is on storage: temp file, fsync, rename. A directory without a valid manifest, or whose files
do not match the manifest's sizes and SHA-256 checksums, is never loaded: the loader falls
back to the previous complete checkpoint. The state dict is the strategies' canonical layout
(strategies/base.py), so a checkpoint saved by any strategy at any world size loads into any
other. DCP stores tensors; its small pickled ``.metadata`` is read with an unpickler that allows
only DCP's own metadata classes, so loading a checkpoint cannot run arbitrary code. ``root`` is a
local or shared path, or an fsspec URL (``s3://bucket/run``, ``memory://`` ...).

Example (every rank calls, in the same order)::

    checkpointer = Checkpointer(root="runs/x/checkpoints", every_steps=50, num_to_keep=2,
                                config_hash="ab12", global_batch_size=64, async_save=True)
    pending = checkpointer.save(step, strategy.state_dict(state), strategy="zero3", world_size=4,
                                group=checkpoint_group)
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

MANIFEST_NAME = "manifest.json"
FORMAT = "dcp-v1"


@dataclass(frozen=True, kw_only=True)
class CheckpointManifest:
    step: int
    """Optimizer steps committed in this state; training resumes at the next one."""
    world_size: int
    strategy: str
    samples_consumed: int
    """The data cursor: position in the global sample stream (step * global_batch_size)."""
    config_hash: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every file of the checkpoint: {"size": bytes, "sha256": hex}."""
    versions: dict[str, str] = field(default_factory=dict)
    format: str = FORMAT
    created_at: float = 0.0


@dataclass(frozen=True)
class Checkpoint:
    path: str
    manifest: CheckpointManifest


@dataclass(frozen=True)
class Rejected:
    path: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Checkpointer:
    """Where and how often the group saves, and how many complete checkpoints it keeps."""

    root: str
    every_steps: int
    num_to_keep: int
    config_hash: str
    global_batch_size: int
    async_save: bool = False

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def directory(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/step_{step:08d}"

    def save(self, step: int, state_dict: dict[str, Any], *, strategy: str, world_size: int,
             group: dist.ProcessGroup | None = None) -> Future:
        """Collective: every rank writes its shard of ``state_dict``; rank 0 then writes the manifest and
        prunes. Returns a future that is done when the checkpoint is complete (at once unless async)."""
        directory = self.directory(step)
        if dist.get_rank() == 0:
            fs, path = _filesystem(directory)
            if fs.exists(path):  # an incomplete earlier attempt at this step
                fs.rm(path, recursive=True)
            fs.makedirs(path, exist_ok=True)
        dist.barrier(group=group)
        manifest = CheckpointManifest(step=step, world_size=world_size, strategy=strategy,
                                      samples_consumed=step * self.global_batch_size,
                                      config_hash=self.config_hash, versions=_versions())
        if not self.async_save:
            dcp.save(state_dict, storage_writer=_writer(directory), process_group=group)
            return self._completed(directory, manifest)
        staged = dcp.async_save(state_dict, storage_writer=_writer(directory), process_group=group)
        done: Future = Future()

        def finish(result: Future) -> None:
            try:
                result.result()
                done.set_result(self._completed(directory, manifest).result())
            except Exception as error:  # noqa: BLE001 - reported through the future
                done.set_exception(error)

        staged.add_done_callback(finish)
        return done

    def _completed(self, directory: str, manifest: CheckpointManifest) -> Future:
        finished: Future = Future()
        if dist.get_rank() == 0:
            write_manifest(directory, manifest)
            prune_checkpoints(self.root, self.num_to_keep)
        finished.set_result(directory)
        return finished


def write_manifest(directory: str, manifest: CheckpointManifest) -> None:
    """Checksum every file of ``directory`` and write the manifest atomically, last."""
    fs, path = _filesystem(directory)
    files = {}
    for name in sorted(fs.ls(path, detail=False)):
        base = name.rstrip("/").rsplit("/", 1)[-1]
        if base != MANIFEST_NAME and not base.endswith(".tmp"):
            files[base] = {"size": fs.size(name), "sha256": _sha256(fs, name)}
    complete = CheckpointManifest(**{**asdict(manifest), "files": files, "created_at": time.time()})
    _write_atomically(fs, f"{path}/{MANIFEST_NAME}", json.dumps(asdict(complete), indent=1))


def read_manifest(directory: str) -> CheckpointManifest | None:
    fs, path = _filesystem(directory)
    try:
        with fs.open(f"{path}/{MANIFEST_NAME}", "r") as handle:
            return CheckpointManifest(**json.load(handle))
    except (OSError, ValueError, TypeError):
        return None


def verify(directory: str, manifest: CheckpointManifest) -> str | None:
    """Why ``directory`` must not be loaded (a missing, truncated or altered file), or None if intact."""
    fs, path = _filesystem(directory)
    if manifest.format != FORMAT:
        return f"format {manifest.format!r}, expected {FORMAT!r}"
    for name, expected in manifest.files.items():
        file = f"{path}/{name}"
        if not fs.exists(file):
            return f"{name} is missing"
        if fs.size(file) != expected["size"]:
            return f"{name} has {fs.size(file)} bytes, the manifest says {expected['size']}"
        if _sha256(fs, file) != expected["sha256"]:
            return f"{name} does not match its checksum"
    return None


def complete_checkpoints(root: str | os.PathLike) -> list[Checkpoint]:
    """Checkpoints under ``root`` with a manifest, oldest first (not yet verified)."""
    fs, path = _filesystem(root)
    if not fs.exists(path):
        return []
    found = []
    for directory in fs.ls(path, detail=False):
        if directory.rstrip("/").rsplit("/", 1)[-1].startswith("step_"):
            manifest = read_manifest(_same_scheme(root, directory))
            if manifest is not None:
                found.append(Checkpoint(_same_scheme(root, directory), manifest))
    return sorted(found, key=lambda c: c.manifest.step)


def newest_loadable(root: str | os.PathLike) -> tuple[Checkpoint | None, list[Rejected]]:
    """The newest complete checkpoint whose files are intact, and the newer ones rejected on the way."""
    rejected = []
    for checkpoint in reversed(complete_checkpoints(root)):
        reason = verify(checkpoint.path, checkpoint.manifest)
        if reason is None:
            return checkpoint, rejected
        rejected.append(Rejected(checkpoint.path, reason))
    return None, rejected


def latest_checkpoint(root: str | os.PathLike) -> Checkpoint | None:
    return newest_loadable(root)[0]


def load_into(state_dict: dict[str, Any], directory: str, group: dist.ProcessGroup | None = None) -> None:
    """Collective: fill ``state_dict`` (canonical layout, this rank's shards) from ``directory``."""
    dcp.load(state_dict, storage_reader=_reader(directory), process_group=group)


def prune_checkpoints(root: str, num_to_keep: int) -> None:
    """Remove complete checkpoints beyond the newest ``num_to_keep``, and incomplete ones older than
    the newest complete one (never one that may still be being written)."""
    complete = complete_checkpoints(root)
    if not complete:
        return
    keep = {c.path for c in complete[-num_to_keep:]}
    newest = complete[-1].manifest.step
    fs, path = _filesystem(root)
    for directory in fs.ls(path, detail=False):
        name = directory.rstrip("/").rsplit("/", 1)[-1]
        if not name.startswith("step_") or _same_scheme(root, directory) in keep:
            continue
        if int(name.removeprefix("step_")) < newest:
            fs.rm(directory, recursive=True)


def _filesystem(url: str | os.PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(str(url))


def _same_scheme(root: str, path: str) -> str:
    """``path`` as listed by fsspec, written with ``root``'s protocol prefix (if any)."""
    protocol, sep, _ = str(root).partition("://")
    if not sep:
        return path
    return path if "://" in path else f"{protocol}://{path}"


def _is_url(path: str) -> bool:
    return "://" in str(path)


def _writer(directory: str) -> FileSystemWriter | FsspecWriter:
    return FsspecWriter(directory) if _is_url(directory) else FileSystemWriter(directory, sync_files=True)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its ``.metadata``; unpickle only the plain classes that file is made of, so a
    planted checkpoint cannot run code (the manifest's checksums cannot help if it is planted too)."""

    ALLOWED = {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or (module, name) in self.ALLOWED or module == "torch.distributed.checkpoint.metadata":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class _SafeMetadata:
    """Mixed into DCP's readers: read ``.metadata`` with the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    pass


class _SafeFsspecReader(_SafeMetadata, FsspecReader):
    pass


def _reader(directory: str) -> FileSystemReader | FsspecReader:
    return _SafeFsspecReader(directory) if _is_url(directory) else _SafeFileSystemReader(directory)


def _write_atomically(fs: fsspec.AbstractFileSystem, path: str, text: str) -> None:
    temporary = f"{path}.tmp"
    if isinstance(fs, LocalFileSystem):
        with open(temporary, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        descriptor = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        return
    with fs.open(temporary, "w") as handle:
        handle.write(text)
    fs.mv(temporary, path)


def _sha256(fs: fsspec.AbstractFileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__}
    for package in ("ray", "raylastic"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return versions
