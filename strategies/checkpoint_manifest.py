"""A checkpoint's manifest: what the directory holds, written atomically and last, and the check against it.

``manifest.json`` names the step, the data cursor, the strategy and world size that saved it, the job's
math hash, and every file of the checkpoint with its size and SHA-256 checksum. It is written (temp file,
fsync, rename) only once every rank's files are on storage, so a directory without one is incomplete; a
directory whose files do not match it, or whose DCP ``.metadata`` is not DCP's plain own (read by
strategies/checkpoint_metadata.py) or names files it does not list, is never loaded. The manifest's names
are plain file names in its directory (no ``/``, no ``..``), and each must be a regular file there: a named
pipe, a device or a symbolic link out of the directory is refused before it is opened, so a planted
manifest can neither read outside the checkpoint nor block the reader.

``.raylastic-checkpoint``, the marker, is written into a step directory before any rank writes into it:
only a directory with the marker or with a manifest is ours to delete (strategies/checkpoint.py).

Example::

    write_manifest(directory, CheckpointManifest(step=120, world_size=4, strategy="zero3",
                                                 samples_consumed=7680, config_hash="ab12"))
    manifest = read_manifest(directory)        # None: missing or malformed
    problem = verify(directory, manifest)      # None: intact
    file_problem(directory, "../x")            # "'../x' is not a plain file name in the checkpoint directory"
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import stat
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from raylastic.strategies.atomic_file import write_atomically

MANIFEST_NAME = "manifest.json"
METADATA_NAME = ".metadata"
"""DCP's index of the checkpoint: which file holds which shard; written by rank 0."""
FORMAT = "dcp-v1"
MARKER_NAME = ".raylastic-checkpoint"
"""Written first into every step directory we make: only a directory with it (or with a manifest) is deleted."""
_MARKER_TEXT = "Raylastic writes checkpoints into this directory and may delete it when it prunes old ones.\n"
_FILE_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFSOCK: "a socket",
               stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


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
    layout: dict[str, int] = field(default_factory=dict)
    """The model-parallel layout it was saved in (ParallelLayout's fields: "pp", "dp_replicate", "dp_shard", "tp",
    "stages_per_rank", "v_shape"); empty: every rank a data-parallel one. It loads in any other."""
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
    """``directory``'s manifest, or None when it has none, it is malformed or it is not a regular file."""
    fs, path = filesystem(directory)
    try:
        if file_problem(directory, MANIFEST_NAME) is not None:
            return None
        with fs.open(f"{path}/{MANIFEST_NAME}", "r") as handle:
            manifest = CheckpointManifest(**json.load(handle))
    except (OSError, ValueError, TypeError):
        return None
    well_formed = isinstance(manifest.step, int) and isinstance(manifest.files, dict)
    return manifest if well_formed else None


def verify(directory: str, manifest: CheckpointManifest, *, checksummed: Collection[str] | None = None,
           metadata: bool = True) -> str | None:
    """Why ``directory`` must not be loaded (a missing, truncated or altered file, metadata that is not
    DCP's plain own or names files the manifest does not list), or None if it is intact. ``checksummed``: the
    files whose checksums are compared (None: all); the others are checked by their size only, without being
    read (``checksum_share``: each loading rank reads its share). ``metadata=False``: DCP's metadata is not
    read either (reading it imports torch: the Controller leaves it to the ranks that load)."""
    try:
        return _problem(directory, manifest, checksummed, metadata)
    except Exception as error:  # noqa: BLE001 - whatever is wrong with it, it is not loaded
        return f"cannot be checked: {type(error).__name__}: {error}"


def checksum_share(manifest: CheckpointManifest, rank: int, world_size: int) -> list[str]:
    """The files whose checksums ``rank`` of ``world_size`` loading ranks compares: the files split by size
    (largest first, each to the rank with the fewest bytes so far), so every file is read once and the ranks
    read about as much. The same split on every rank."""
    load = [0] * world_size
    shares: list[list[str]] = [[] for _ in range(world_size)]
    for name in sorted(manifest.files, key=lambda n: (-manifest.files[n]["size"], n)):
        lightest = min(range(world_size), key=lambda r: (load[r], r))
        shares[lightest].append(name)
        load[lightest] += manifest.files[name]["size"]
    return shares[rank]


def _problem(directory: str, manifest: CheckpointManifest, checksummed: Collection[str] | None,
             metadata: bool) -> str | None:
    fs, path = filesystem(directory)
    if manifest.format != FORMAT:
        return f"format {manifest.format!r}, expected {FORMAT!r}"
    for name, expected in manifest.files.items():
        file = f"{path}/{name}"
        if (problem := file_problem(directory, name)) is not None:
            return problem
        if fs.size(file) != expected["size"]:
            return f"{name} has {fs.size(file)} bytes, the manifest says {expected['size']}"
        if (checksummed is None or name in checksummed) and _sha256(fs, file) != expected["sha256"]:
            return f"{name} does not match its checksum"
    if (problem := file_problem(directory, METADATA_NAME)) is not None or not metadata:
        return problem
    from raylastic.strategies.checkpoint_metadata import load_metadata  # torch's DCP classes: only where one is checked

    try:
        with fs.open(f"{path}/{METADATA_NAME}", "rb") as handle:
            metadata = load_metadata(handle)
    except pickle.UnpicklingError as error:
        return f"{METADATA_NAME} is refused: {error}"
    unlisted = sorted({info.relative_path for info in metadata.storage_data.values()} - manifest.files.keys())
    return f"{unlisted[0]} holds state but is not in the manifest" if unlisted else None


def file_problem(directory: str, name: object) -> str | None:
    """Why ``name`` is not a regular file of ``directory`` that may be read: not a plain file name in it,
    missing, a named pipe, device or directory, or a symbolic link out of it. None: it may be opened.
    Nothing is opened to find out (a named pipe would block the reader)."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        return f"{name!r} is not a plain file name in the checkpoint directory (no '/', '\\' or '..')"
    fs, path = filesystem(directory)
    if isinstance(fs, LocalFileSystem):
        return _local_file_problem(path, name)
    try:
        kind = fs.info(f"{path}/{name}")["type"]
    except FileNotFoundError:
        return f"{name} is missing"
    return None if kind == "file" else f"{name} is not a regular file (fsspec type {kind!r})"


def _local_file_problem(directory: str, name: str) -> str | None:
    file = os.path.join(directory, name)
    try:
        mode = os.lstat(file).st_mode
        if stat.S_ISLNK(mode):
            inside = os.path.realpath(directory)
            if os.path.commonpath([inside, os.path.realpath(file)]) != inside:
                return f"{name} is a symbolic link out of the checkpoint directory (to {os.path.realpath(file)})"
            mode = os.stat(file).st_mode
    except FileNotFoundError:
        return f"{name} is missing"
    if stat.S_ISREG(mode):
        return None
    return f"{name} is {_FILE_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, not a regular file"


def write_marker(directory: str) -> None:
    """Mark ``directory`` (made by us, before anything is written into it) as ours to delete."""
    fs, path = filesystem(directory)
    with fs.open(f"{path}/{MARKER_NAME}", "w") as handle:
        handle.write(_MARKER_TEXT)


def written_by_us(directory: str) -> bool:
    """Whether ``directory`` is a checkpoint directory we made: it holds our marker, or a manifest (a
    checkpoint complete before the marker existed)."""
    fs, path = filesystem(directory)
    return fs.isfile(f"{path}/{MARKER_NAME}") or read_manifest(directory) is not None


def filesystem(url: str | os.PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(str(url))


def _write_atomically(fs: fsspec.AbstractFileSystem, path: str, text: str) -> None:
    if isinstance(fs, LocalFileSystem):
        write_atomically(path, lambda handle: handle.write(text.encode()))
        return
    temporary = f"{path}.tmp"
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
    """{name: {"size", "sha256"}} of ``directory``'s files ``names``; ValueError if one is not a regular file."""
    fs, path = filesystem(directory)
    for name in names:
        if (problem := file_problem(directory, name)) is not None:
            raise ValueError(f"{path}: {problem}")
    return {name: {"size": fs.size(f"{path}/{name}"), "sha256": _sha256(fs, f"{path}/{name}")} for name in names}
