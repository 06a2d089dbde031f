"""Sharded, resharding checkpoints: torch.distributed.checkpoint (DCP) plus a JSON manifest.

Layout: ``<root>/step_00000120/`` holds DCP's files (one or more per rank, written in parallel,
and DCP's ``.metadata``) and ``manifest.json`` (strategies/checkpoint_manifest.py), written last by rank 0
once every rank's shard is on storage: temp file, fsync, rename. Each rank checksums the files it wrote itself, so the
manifest lists every rank's files even where each node writes to a disk of its own. A directory
without a valid manifest, or whose files do not match the manifest's sizes and SHA-256 checksums,
is never loaded: the loader falls back to the previous complete checkpoint. A complete checkpoint is
deleted only by pruning, once a newer one (a higher step, written later) is complete, and only directories
we wrote (marked before any rank writes into them, or holding a manifest) are ever deleted. The state dict
is the strategies' canonical layout (strategies/base.py), so a checkpoint saved by any strategy at
any world size loads into any other. Checkpoints hold tensors only; DCP's small pickled
``.metadata`` is read by strategies/checkpoint_metadata.py, which allows only DCP's own classes, so loading a
checkpoint cannot run arbitrary code. ``root`` is a local or shared path, or an fsspec URL
(``s3://bucket/run``, ``memory://`` ...). Which checkpoints exist, are complete and may be loaded, and pruning:
strategies/checkpoint_catalogue.py (no torch: the Controller reads it).

Example (every rank calls, in the same order)::

    checkpointer = Checkpointer(root="runs/x/checkpoints", every_steps=50, num_to_keep=2,
                                config_hash="ab12", global_batch_size=64, async_save=True)
    pending = checkpointer.save(step, strategy.state_dict(state), strategy="zero3", world_size=4,
                                group=checkpoint_group)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

from raylastic.strategies.checkpoint_catalogue import CheckpointSettings, prune_checkpoints
from raylastic.strategies.checkpoint_manifest import (
    MARKER_NAME,
    METADATA_NAME,
    CheckpointManifest,
    checksum_share,
    checksums,
    filesystem,
    read_manifest,
    verify,
    write_manifest,
    write_marker,
    written_by_us,
)
from raylastic.strategies.checkpoint_metadata import safe_reader
from raylastic.strategies.plain_objects import all_gather_plain, broadcast_plain

logger = logging.getLogger(__name__)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written: "could not write checkpoint <directory>: <cause>"."""


class CheckpointLoadError(RuntimeError):
    """A checkpoint could not be loaded: "could not load checkpoint <directory>: <cause>"."""


@dataclass(frozen=True)
class _Preparation:
    """Rank 0's word to every rank before a save: write it, it is saved already, or it cannot be written."""

    action: Literal["write", "saved", "failed"]
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class Checkpointer(CheckpointSettings):
    """Saves the group's checkpoints where and as often as its settings say."""

    @classmethod
    def of(cls, settings: CheckpointSettings) -> Checkpointer:
        return settings if isinstance(settings, Checkpointer) else cls(**dataclasses.asdict(settings))

    def save(self, step: int, state_dict: dict[str, Any], *, strategy: str, world_size: int,
             group: dist.ProcessGroup | None = None, layout: dict[str, int] | None = None,
             asynchronous: bool | None = None) -> Future:
        """Collective: every rank writes its shard of ``state_dict`` and checksums the files it wrote; rank 0
        writes the manifest from every rank's list, then prunes. Returns a future that is done with the
        checkpoint's directory when the checkpoint is complete (at once unless async: ``asynchronous``, or
        ``async_save`` when it is None). A failure raises CheckpointWriteError here, or resolves the future with
        it, on every rank it reaches.

        Start the next save on ``group`` only after this one's future is done: completing it uses ``group``.
        """
        _require_tensors(state_dict)
        directory = self.directory(step)
        # Nobody writes before rank 0 has prepared the directory.
        mine = dataclasses.asdict(self._prepare(directory)) if dist.get_rank(group) == 0 else None
        prepared = _Preparation(**broadcast_plain(mine, src=0, group=group))
        if prepared.action == "failed":
            raise _write_error(directory, prepared.reason)
        if prepared.action == "saved":
            return _resolved(directory)
        manifest = CheckpointManifest(step=step, world_size=world_size, strategy=strategy,
                                      samples_consumed=step * self.global_batch_size,
                                      config_hash=self.config_hash, versions=_versions(), layout=layout or {})
        with _as_write_error(directory):
            if not (self.async_save if asynchronous is None else asynchronous):
                dcp.save(state_dict, storage_writer=_writer(directory), process_group=group)
                return _resolved(self._complete(directory, manifest, group))
            staged = dcp.async_save(state_dict, storage_writer=_writer(directory), process_group=group)
        done: Future = Future()

        def finish(result: Future) -> None:
            try:
                with _as_write_error(directory):
                    result.result()
                    done.set_result(self._complete(directory, manifest, group))
            except BaseException as error:  # noqa: BLE001 - in DCP's thread: only the future can report it
                done.set_exception(error)

        staged.add_done_callback(finish)
        return done

    def _prepare(self, directory: str) -> _Preparation:
        """Rank 0: an empty directory to write into, marked as ours before anything else is written. An intact
        checkpoint of this job already there (a finished run run again) is kept as this save, never deleted to
        be written again; a directory holding files we did not write is left alone and the save fails."""
        try:
            fs, path = filesystem(directory)
            if fs.exists(path):
                existing = read_manifest(directory)
                if existing is not None and verify(directory, existing) is None:
                    if existing.config_hash == self.config_hash:
                        return _Preparation("saved")
                    return _Preparation("failed", f"it holds a complete checkpoint of another job (config hash "
                                                  f"{existing.config_hash}, this job's is {self.config_hash})")
                if not written_by_us(directory) and fs.ls(path, detail=False):
                    return _Preparation("failed", f"it holds files that Raylastic did not write (it has no "
                                                  f"{MARKER_NAME} and no manifest), which are never deleted: move "
                                                  f"them, or set checkpoint.path to another directory")
                fs.rm(path, recursive=True)  # ours: an incomplete or damaged earlier attempt at this step
            fs.makedirs(path, exist_ok=True)
            write_marker(directory)
        except Exception as error:  # noqa: BLE001 - every rank must hear of it, or the others would wait
            return _Preparation("failed", _cause(error))
        return _Preparation("write")

    def _complete(self, directory: str, manifest: CheckpointManifest, group: dist.ProcessGroup | None) -> str:
        """Collective: every rank checksums the files it wrote (on its own disk, where a node's disk is
        local) and rank 0 writes the manifest of them all, last."""
        rank = dist.get_rank(group)
        try:
            mine: dict[str, dict[str, Any]] | str = checksums(directory, _files_written(directory, rank))
        except Exception as error:  # noqa: BLE001 - sent to every rank instead
            mine = f"rank {rank}: {_cause(error)}"
        every = all_gather_plain(mine, group=group)
        problems = [files for files in every if isinstance(files, str)]
        if problems:
            raise _write_error(directory, "; ".join(problems))
        if rank == 0:
            with _as_write_error(directory):
                write_manifest(directory, manifest, files={k: v for files in every for k, v in files.items()})
            try:
                prune_checkpoints(self.root, self.num_to_keep, written_step=manifest.step)
            except Exception as error:  # noqa: BLE001 - the checkpoint is complete; the old ones stay for now
                logger.warning("could not remove old checkpoints under %s: %s", self.root, _cause(error))
        return directory


def verify_for_load(directory: str, group: dist.ProcessGroup | None = None) -> str | None:
    """Collective over the loading ranks: each compares the checksums of its share of ``directory``'s files
    (``checksum_share``), so each file is read once, on a rank that loads the checkpoint. Returns why the
    checkpoint must not be loaded (the same on every rank), or None."""
    manifest = read_manifest(directory)
    if manifest is None:
        problem = f"{directory} has no readable manifest"
    else:
        share = checksum_share(manifest, dist.get_rank(group), dist.get_world_size(group))
        problem = verify(directory, manifest, checksummed=share)
    problems = all_gather_plain(problem, group=group)
    return next((p for p in problems if p is not None), None)


def load_into(state_dict: dict[str, Any], directory: str, group: dist.ProcessGroup | None = None, *,
              partial: bool = False) -> None:
    """Collective: fill ``state_dict`` (canonical layout, this rank's shards) from ``directory``; raises
    CheckpointLoadError naming it and the cause. With ``partial``, entries the checkpoint lacks are left as
    they are."""
    planner = DefaultLoadPlanner(allow_partial_load=True) if partial else None
    try:
        dcp.load(state_dict, storage_reader=safe_reader(directory), planner=planner, process_group=group)
    except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
        raise CheckpointLoadError(f"could not load checkpoint {directory}: {_cause(error)}") from error


def _is_url(path: str) -> bool:
    return "://" in str(path)


def _writer(directory: str) -> FileSystemWriter | FsspecWriter:
    return FsspecWriter(directory) if _is_url(directory) else FileSystemWriter(directory, sync_files=True)


def _files_written(directory: str, rank: int) -> list[str]:
    """The files of a save that ``rank`` (of the saving group) wrote: DCP's FileSystemWriter names each
    rank's ``__<rank>_<n>.distcp``, and the coordinator, rank 0, writes ``.metadata``. Read off the directory,
    emptied before the save, since the metadata DCP's save returns lists no files in some torch versions."""
    fs, path = filesystem(directory)
    names = (entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False))
    return sorted(name for name in names if name.startswith(f"__{rank}_")) + ([METADATA_NAME] if rank == 0 else [])


def _require_tensors(state_dict: dict[str, Any]) -> None:
    """DCP would pickle anything else, and loading a pickle can run code: checkpoints hold tensors only."""
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"checkpoint state {key!r} is of type {type(value).__name__}; only tensors are saved")


def _resolved(directory: str) -> Future:
    done: Future = Future()
    done.set_result(directory)
    return done


def _write_error(directory: str, cause: BaseException | str) -> CheckpointWriteError:
    return CheckpointWriteError(f"could not write checkpoint {directory}: {_cause(cause)}")


@contextlib.contextmanager
def _as_write_error(directory: str) -> Iterator[None]:
    """Any failure inside, DCP's CheckpointException (a BaseException) too, as CheckpointWriteError."""
    try:
        yield
    except CheckpointWriteError:
        raise
    except (Exception, CheckpointException) as error:
        raise _write_error(directory, error) from error


def _cause(error: BaseException | str) -> str:
    """One line per failure: DCP's CheckpointException carries one per failed rank."""
    if isinstance(error, str):
        return error
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {_cause(failure)}" for rank, (failure, _) in sorted(error.failures.items()))
    return f"{type(error).__name__}: {error}"


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__}
    for package in ("ray", "raylastic"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return versions
