"""A checkpoint's manifest: what the directory holds, written atomically and last, and the check against it.

``manifest.json`` names the step, the data cursor, the strategy and world size that saved it, the job's
math hash, and every file of the checkpoint with its size and SHA-256 checksum. It is written (temp file,
fsync, rename) only once every rank's files are on storage, so a directory without one is incomplete; a
directory whose files do not match it, or whose DCP ``.metadata`` is not DCP's plain own (read by
strategies/checkpoint_metadata.py) or names files it does not list, is never loaded.

Example::

    write_manifest(directory, CheckpointManifest(step=120, world_size=4, strategy="zero3",
                                                 samples_consumed=7680, config_hash="ab12"))
    manifest = read_manifest(directory)        # None: missing or malformed
    problem = verify(directory, manifest)      # None: intact
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from strategies.checkpoint_metadata import load_metadata

MANIFEST_NAME = "manifest.json"
METADATA_NAME = ".metadata"
"""DCP's index of the checkpoint: which file holds which shard; written by rank 0."""
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


def write_manifest(directory: str, manifest: CheckpointManifest,
                   files: dict[str, dict[str, Any]] | None = None) -> None:
    """Write ``directory``'s manifest atomically, last: ``files`` ({name: {"size", "sha256"}}), or, if None,
    checksums of every file this process sees in ``directory``."""
    fs, path = filesystem(directory)
    if files is None:
        names = [name.rstrip("/").rsplit("/", 1)[-1] for name in fs.ls(path, detail=False)]
        files = checksums(directory, [n for n in names if n != MANIFEST_NAME and not n.endswith(".tmp")])
    complete = CheckpointManifest(**{**asdict(manifest), "files": dict(sorted(files.items())),
                                     "created_at": time.time()})
    _write_atomically(fs, f"{path}/{MANIFEST_NAME}", json.dumps(asdict(complete), indent=1))


def read_manifest(directory: str) -> CheckpointManifest | None:
    fs, path = filesystem(directory)
    try:
        with fs.open(f"{path}/{MANIFEST_NAME}", "r") as handle:
            manifest = CheckpointManifest(**json.load(handle))
    except (OSError, ValueError, TypeError):
        return None
    well_formed = isinstance(manifest.step, int) and isinstance(manifest.files, dict)
    return manifest if well_formed else None


def verify(directory: str, manifest: CheckpointManifest) -> str | None:
    """Why ``directory`` must not be loaded (a missing, truncated or altered file, metadata that is not
    DCP's plain own or names files the manifest does not list), or None if it is intact."""
    try:
        return _problem(directory, manifest)
    except Exception as error:  # noqa: BLE001 - whatever is wrong with it, it is not loaded
        return f"cannot be checked: {type(error).__name__}: {error}"


def _problem(directory: str, manifest: CheckpointManifest) -> str | None:
    fs, path = filesystem(directory)
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
    try:
        with fs.open(f"{path}/{METADATA_NAME}", "rb") as handle:
            metadata = load_metadata(handle)
    except pickle.UnpicklingError as error:
        return f"{METADATA_NAME} is refused: {error}"
    unlisted = sorted({info.relative_path for info in metadata.storage_data.values()} - manifest.files.keys())
    return f"{unlisted[0]} holds state but is not in the manifest" if unlisted else None


def filesystem(url: str | os.PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(str(url))


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


def checksums(directory: str, names: list[str]) -> dict[str, dict[str, Any]]:
    fs, path = filesystem(directory)
    return {name: {"size": fs.size(f"{path}/{name}"), "sha256": _sha256(fs, f"{path}/{name}")} for name in names}
