"""Saves of one gloo process group into a checkpoint root, for the checkpoint tests (run by
tests/support/distributed_harness.py's ``run_distributed``): every rank writes a shard of its own.

Example::

    outcomes = run_distributed(save_steps, 2, Saves(str(root), (1, 2)))  # per rank: ["ok <dir>", ...]
"""

from __future__ import annotations

import dataclasses
import resource
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from raylastic.strategies.checkpoint import Checkpointer
from raylastic.strategies.checkpoint_manifest import read_manifest, write_manifest

SHARD_VALUES = 4096


def sharded_state(offset: float = 0.0) -> dict[str, torch.Tensor]:
    """Every rank's shard of a ZeRO-3 style state (a DTensor), so that every rank writes a file of its own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {"model.w": distribute_tensor(torch.arange(float(SHARD_VALUES)) + offset, mesh, [Shard(0)])}


@dataclass(frozen=True)
class Saves:
    """Saves of one process group: ``steps`` in order, into ``root``."""

    root: str
    steps: tuple[int, ...]
    num_to_keep: int = 10
    async_save: bool = False
    config_hash: str = "job"
    failing_rank: int | None = None
    """On this rank, writes during ``failing_steps`` fail as on a full disk: a file-size limit (the kernel
    answers EFBIG; Python ignores SIGXFSZ)."""
    failing_steps: tuple[int, ...] = ()
    bare_dcp_result: bool = False
    """DCP's save returns its metadata without ``storage_data`` (which files hold what), as torch 2.11's did."""


def save_steps(saves: Saves) -> list[str]:
    """On every rank: what each save came to, "ok <dir>" or the error; "hung" if it neither completes nor
    fails within 30 s."""
    checkpointer = Checkpointer(root=saves.root, every_steps=1, num_to_keep=saves.num_to_keep,
                                config_hash=saves.config_hash, global_batch_size=1, async_save=saves.async_save)
    if saves.bare_dcp_result:
        _return_bare_metadata()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    outcomes = []
    for step in saves.steps:
        failing = dist.get_rank() == saves.failing_rank and step in saves.failing_steps
        if failing:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limits[1]))
        started = time.monotonic()
        try:
            path = checkpointer.save(step, sharded_state(step), strategy="zero3",
                                     world_size=dist.get_world_size()).result(timeout=30)
            outcomes.append(f"ok {path}")
        except TimeoutError:
            outcomes.append("hung")
        except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
            outcomes.append(f"{type(error).__name__} after {time.monotonic() - started:.1f} s: {error}")
        finally:
            if failing:
                resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    return outcomes


def _return_bare_metadata() -> None:
    import torch.distributed.checkpoint as dcp

    def bare(metadata):
        return dataclasses.replace(metadata, storage_data=None)

    save, async_save = dcp.save, dcp.async_save
    dcp.save = lambda *args, **kwargs: bare(save(*args, **kwargs))

    def async_bare(*args, **kwargs):
        staged, returned = async_save(*args, **kwargs), Future()
        staged.add_done_callback(lambda done: returned.set_result(bare(done.result())))
        return returned

    dcp.async_save = async_bare


def step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


def replant_manifest(directory: Path) -> None:
    """What an attacker who can write the checkpoint does too: checksums that match the planted files."""
    write_manifest(str(directory), read_manifest(str(directory)))
