"""Rank bodies of benchmarks/checkpoint.py (module level, so the harness's ranks import them).

Every time is rank 0's, from a barrier before to a barrier after: until every rank is done.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from benchmarks._sharded_setup import GPT_50M, Setup, set_up
from raylastic.strategies.checkpoint import Checkpointer, load_into
from raylastic.strategies.checkpoint_manifest import read_manifest, write_manifest

GPT_10M = {"n_layer": 6, "n_head": 8, "n_embd": 384, "block_size": 64}
PERIOD, ASYNC_BATCH = 8, 2
MODES = ("none", "sync", "async")


def timed(action: Callable[[], object]) -> float:
    dist.barrier()
    started = time.perf_counter()
    action()
    dist.barrier()
    return time.perf_counter() - started


def sums(flat: dict) -> torch.Tensor:
    """Per-tensor float64 sums of the sharded entries, over all ranks (the same at any world size)."""
    keys = sorted(k for k, v in flat.items() if isinstance(v, DTensor))
    local = torch.stack([flat[k].to_local().double().sum() for k in keys])
    dist.all_reduce(local)
    return local


def zero_state(flat: dict) -> None:
    with torch.no_grad():
        for value in flat.values():
            if isinstance(value, torch.Tensor):
                (value.to_local() if isinstance(value, DTensor) else value).zero_()


def drop_page_cache(path: Path) -> None:
    if dist.get_rank() == 0:
        for file in [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]:
            descriptor = os.open(file, os.O_RDONLY)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(descriptor)
    dist.barrier()


def torch_save_rank0(flat: dict, path: Path) -> dict[str, float]:
    gathered: dict[str, torch.Tensor] = {}

    def gather() -> None:
        for key in sorted(flat):
            value = flat[key]
            full = value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
            if dist.get_rank() == 0:
                gathered[key] = full

    def write() -> None:
        if dist.get_rank() == 0:
            with open(path, "wb") as handle:
                torch.save(gathered, handle)
                handle.flush()
                os.fsync(handle.fileno())

    return {"torch_save_gather_s": timed(gather), "torch_save_write_s": timed(write)}


def torch_load_rank0(flat: dict, path: Path) -> None:
    full = torch.load(path, weights_only=True) if dist.get_rank() == 0 else {}
    with torch.no_grad():
        for key in sorted(flat):
            target = flat[key]
            if isinstance(target, DTensor):
                source = full[key] if full else torch.empty(target.shape, dtype=target.dtype)
                shard = distribute_tensor(source, target.device_mesh, target.placements, src_data_rank=0)
                target.to_local().copy_(shard.to_local())
            else:
                source = full[key] if full else target
                dist.broadcast(source, src=0)
                target.copy_(source)


@dataclass
class SaveLoad:
    """One rank's zero3 state and the saves and loads timed on it."""

    setup: Setup
    group: dist.ProcessGroup

    def dcp_save(self, checkpointer: Checkpointer, step: int) -> dict[str, float]:
        state, world_size = self.setup.state, dist.get_world_size()
        save_s = timed(lambda: checkpointer.save(step, self.setup.strategy.state_dict(state), strategy="zero3",
                                                 world_size=world_size, group=self.group).result())
        directory = checkpointer.directory(step)
        manifest_s = timed(lambda: dist.get_rank() == 0 and write_manifest(directory, read_manifest(directory)))
        return {"dcp_save_s": save_s, "manifest_s": manifest_s}

    def load(self, kind: str, path: Path, expected: torch.Tensor) -> float:
        """Seconds to load ``path`` (a DCP directory or a torch.save file) into the zeroed live state."""
        strategy, state = self.setup.strategy, self.setup.state
        drop_page_cache(path)
        zero_state(strategy.state_dict(state))
        flat = strategy.state_dict(state)

        def restore() -> None:
            if kind == "dcp":
                load_into(flat, str(path), group=self.group)
            else:
                torch_load_rank0(flat, path)
            strategy.load_state_dict(state, flat)

        seconds = timed(restore)
        # float64 sums of the same float32 values: equal up to summation order at another world size
        assert torch.allclose(sums(strategy.state_dict(state)), expected, rtol=1e-9, atol=1e-9), f"{kind}: {path}"
        return seconds


def save_and_load_rank(scratch: str, rounds: int, foreign: dict | None, save: bool = True) -> dict:
    """Rank body of the save/load part; ``foreign`` is another world size's checkpoint to reshard."""
    world_size = dist.get_world_size()
    setup = set_up("zero3", GPT_50M, global_batch_size=world_size, micro_batch_size=1)
    setup.runner.run(setup.state, 0)
    bench = SaveLoad(setup, dist.new_group(backend="gloo"))
    root = Path(scratch) / f"n{world_size}"
    checkpointer = Checkpointer(root=str(root / "dcp"), every_steps=0, num_to_keep=1, config_hash="benchmark",
                                global_batch_size=world_size)
    saved, torch_file = sums(setup.strategy.state_dict(setup.state)), root / "full.pt"
    rows = []
    for step in range(1, rounds + 1 if save else 1):
        row: dict = {}
        for kind in ("dcp", "torch") if step % 2 else ("torch", "dcp"):  # alternate which goes first
            if kind == "dcp":
                row.update(bench.dcp_save(checkpointer, step))
                row["dcp_load_s"] = bench.load("dcp", Path(checkpointer.directory(step)), saved)
            else:
                row.update(torch_save_rank0(setup.strategy.state_dict(setup.state), torch_file))
                row["torch_load_s"] = bench.load("torch", torch_file, saved)
        rows.append(row)
    resharded = [bench.load("dcp", Path(foreign["checkpoint"]), foreign["sums"]) for _ in range(rounds)] \
        if foreign else []
    if dist.get_rank() != 0:
        return {}
    result = {"world_size": world_size, "rounds": rows, "sums": saved, "resharded_load": None}
    if foreign:
        result["resharded_load"] = {"from_world_size": foreign["world_size"], "dcp_load_s": resharded}
    if save:
        directory = Path(checkpointer.directory(rounds))
        result.update(checkpoint=str(directory), dcp_bytes=sum(p.stat().st_size for p in directory.iterdir()),
                      torch_bytes=torch_file.stat().st_size)
    return result


def async_cost_rank(scratch: str, periods: int) -> dict:
    """Rank body of the async part: wall time of one checkpoint period (PERIOD steps, a save after step
    PERIOD // 2, then waiting for it) per mode; the modes take turns, in a rotating order, ``periods`` times."""
    world_size = dist.get_world_size()
    setup = set_up("zero3", GPT_10M, global_batch_size=ASYNC_BATCH, micro_batch_size=ASYNC_BATCH // world_size)
    group = dist.new_group(backend="gloo")  # async saves must not share the training group
    checkpointers = {mode: Checkpointer(root=f"{scratch}/{mode}", every_steps=0, num_to_keep=1,
                                        config_hash="benchmark", global_batch_size=ASYNC_BATCH,
                                        async_save=mode == "async") for mode in MODES}
    step = 0
    for _ in range(2):  # warm-up; creates Adam's state
        setup.runner.run(setup.state, step)
        step += 1
    measured: dict[str, dict[str, list[float]]] = {k: {m: [] for m in MODES} for k in ("wall_s", "save_call_s",
                                                                                         "final_wait_s")}
    for period in range(periods):
        for mode in MODES[period % len(MODES):] + MODES[:period % len(MODES)]:
            pending, save_call_s = None, 0.0
            dist.barrier()
            started = time.perf_counter()
            for index in range(PERIOD):
                setup.runner.run(setup.state, step)
                step += 1
                if mode != "none" and index == PERIOD // 2 - 1:
                    save_started = time.perf_counter()
                    pending = checkpointers[mode].save(step, setup.strategy.state_dict(setup.state),
                                                       strategy="zero3", world_size=world_size, group=group)
                    save_call_s = time.perf_counter() - save_started
            wait_started = time.perf_counter()
            if pending is not None:
                pending.result()
            final_wait_s = time.perf_counter() - wait_started
            dist.barrier()
            for key, value in (("wall_s", time.perf_counter() - started), ("save_call_s", save_call_s),
                               ("final_wait_s", final_wait_s)):
                measured[key][mode].append(value)
    return measured if dist.get_rank() == 0 else {}
