"""Copies to host memory (strategies/host_copies.py) and how the buddy copy uses them (strategies/buddy_copy.py):
the pure decisions (which path, which buffer is reused, which entries a forward may change), the bounded wait,
a snapshot whose copy did not complete being dropped; on CUDA (``-m gpu``), the pinned side-stream copy.

    python -m pytest tests/test_host_copies.py -q     # seconds; the gpu tests skip without CUDA
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist

from raylastic.actors.status.peer_loss import is_peer_loss
from raylastic.strategies.base import scaler_entries
from raylastic.strategies.buddy_copy import BuddyCopies, _Exchange, _Snapshot, changed_by_forward, scaler_sources
from raylastic.strategies.host_copies import BufferPool, HostCopier, PendingCopy, copy_path, reusable_index
from raylastic.strategies.shard_copy import ShardPacker, unpack_shard
from raylastic.strategies.shard_layout import ShardLayout

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_copies_from_a_gpu_go_by_a_side_stream_and_from_cpu_inline():
    assert copy_path(torch.device("cpu"), cuda_available=True) == "inline"
    assert copy_path(torch.device("cuda", 1), cuda_available=True) == "side_stream"
    with pytest.raises(ValueError, match="device: cuda:0 needs CUDA"):
        copy_path(torch.device("cuda", 0), cuda_available=False)


def test_a_buffer_is_reused_only_for_its_exact_size_and_dtype():
    free = [(10, torch.uint8), (12, torch.float32), (12, torch.uint8)]
    assert reusable_index(free, 12, torch.uint8) == 2
    assert reusable_index(free, 11, torch.uint8) is None
    pool = BufferPool(pinned=False)
    first = pool.take(64)
    pool.give_back(first)
    assert pool.take(64).data_ptr() == first.data_ptr() and pool.free == []
    pool.give_back(first)
    other = pool.take(32)  # the state's size changed: the old size is no use any more
    assert other.numel() == 32 and pool.free == [] and not other.is_pinned()


def test_a_cpu_copy_is_done_on_return_ordered_entries_included():
    sources = [torch.arange(6.0).view(2, 3), torch.tensor(7, dtype=torch.int64), torch.zeros(0, 4)]
    targets = [torch.empty_like(source) for source in sources]
    pending = HostCopier(torch.device("cpu")).copy(list(zip(targets[1:], sources[1:], strict=True)),
                                                   ordered=[(targets[0], sources[0])])
    assert pending.done()
    sources[0].add_(1)  # the next step's in-place change does not reach the copy
    assert torch.equal(targets[0], torch.arange(6.0).view(2, 3)) and targets[1].item() == 7


class _Event:
    """A device event that completes after ``after`` queries (never: None)."""

    def __init__(self, after: int | None) -> None:
        self.after, self.queries = after, 0

    def query(self) -> bool:
        self.queries += 1
        return self.after is not None and self.queries > self.after


def test_the_wait_for_a_copy_is_bounded():
    PendingCopy(_Event(after=3)).wait(timeout_s=30)
    started = time.monotonic()
    with pytest.raises(dist.DistNetworkError, match="did not complete within 0.2s") as stalled:
        PendingCopy(_Event(after=None)).wait(timeout_s=0.2)
    assert is_peer_loss(stalled.value)  # a device stuck in a collective with a lost peer: the run recovers
    assert time.monotonic() - started < 30  # bounded: the timeout, and a poll interval's slack


def test_a_snapshot_whose_copy_did_not_complete_is_not_kept():
    copies = BuddyCopies(group=None, layout=ShardLayout(world_size=2, replicas=1, rank=0), generation=3, timeout_s=1)
    flat = {"model.w": torch.arange(4.0)}
    packer = ShardPacker(flat, copies.layout)
    complete, copying = torch.empty(packer.size, dtype=torch.uint8), torch.empty(packer.size, dtype=torch.uint8)
    packer.pack(complete)
    copies._own = [_Snapshot(5, packer.entries, complete), _Snapshot(6, packer.entries, copying)]
    failed: Future = Future()
    failed.set_exception(TimeoutError("a copy to host memory did not complete within 1s"))
    copies._in_flight = _Exchange(6, packer.entries, torch.empty(0, dtype=torch.uint8), PendingCopy(_Event(None)),
                                  failed, given_up=threading.Event())
    assert [k.copy.step for k in copies.kept()] == [5]  # while in flight, only the complete one
    with pytest.raises(TimeoutError):
        copies.finish()
    kept = copies.kept()
    assert [k.copy.step for k in kept] == [5] and torch.equal(kept[0].rows["model.w"], torch.arange(2.0))


def test_the_entries_a_forward_changes_in_place_are_its_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    flat = {f"model.{key}": value for key, value in model.state_dict().items()}
    flat["optim.state.0.weight.exp_avg"] = torch.zeros(4, 3)
    assert changed_by_forward(flat, model) == {"model.1.running_mean", "model.1.running_var",
                                               "model.1.num_batches_tracked"}


def test_the_scalers_entries_are_made_without_reading_them_back(monkeypatch):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(self) or item(self))
    scaler_sources(scaler)  # every step's copy: a read would wait for the device to finish the step's kernels
    assert reads == []
    scaler_entries(scaler)  # a checkpoint's: reads them
    assert reads
    monkeypatch.undo()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for scaled in (False, True):  # the scale tensor exists from the first scaled loss on
        if scaled:
            scaler.scale(torch.ones(()))
        made, read = scaler_sources(scaler), scaler_entries(scaler)
        assert made.keys() == read.keys() == {"scaler.scale", "scaler.growth_tracker"}
        for key in read:
            assert made[key].dtype == read[key].dtype and made[key].shape == read[key].shape == ()
            assert made[key].item() == read[key].item()


@pytest.mark.gpu
@requires_cuda
def test_a_gpu_copy_goes_to_pinned_memory_on_a_side_stream_and_is_exact():
    device = torch.device("cuda", torch.cuda.current_device())
    copier = HostCopier(device)
    assert copier.path == "side_stream"
    flat = {"model.w": torch.randn(1000, 64, device=device), "model.bn.running_mean": torch.randn(64, device=device),
            "optim.step": torch.tensor(3.0, device=device)}
    expected = {key: value.cpu() for key, value in flat.items()}
    layout = ShardLayout(world_size=2, replicas=1, rank=0)
    packer = ShardPacker(flat, layout)
    buffer = copier.pool.take(packer.size)
    assert buffer.is_pinned()
    torch.cuda._sleep(50_000_000)  # the current stream is busy: the side stream must wait for it before reading
    flat["model.w"].mul_(2)
    pending = packer.pack(buffer, copier=copier, ordered={"model.bn.running_mean"})
    flat["model.bn.running_mean"].add_(1)  # the next step's forward: queued after the ordered copies only
    pending.wait(timeout_s=60)
    rows = unpack_shard(packer.entries, buffer, layout)
    assert torch.equal(rows["model.w"], expected["model.w"][:500] * 2)
    assert torch.equal(rows["model.bn.running_mean"], expected["model.bn.running_mean"][:32])
    assert torch.equal(rows["optim.step"], expected["optim.step"])


@pytest.mark.gpu
@requires_cuda
def test_a_gpu_copys_temporary_source_is_not_reused_before_the_copy_has_read_it():
    device = torch.device("cuda", torch.cuda.current_device())
    copier = HostCopier(device)
    target = copier.pool.take(1 << 20, torch.float32)
    torch.cuda._sleep(50_000_000)
    source = torch.full((1 << 20,), 5.0, device=device)
    pending = copier.copy([(target, source)])
    del source  # recorded on the side stream: its memory is not handed out before the copy ran
    torch.full((1 << 20,), -1.0, device=device)
    pending.wait(timeout_s=60)
    assert bool((target == 5.0).all())
