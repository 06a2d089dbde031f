"""GPU workers (NCCL) through Ray: mixed precision, every strategy, a survivor that outlives its killed peer, a
re-plan, a node's workers binding their own GPU and talking P2P.

The GPU tests (marked ``gpu``: the device check, benchmarks/device_check.py, runs them) run one worker per visible
GPU (at most 2) through cluster.job.train and are skipped where torch sees no CUDA device; the kill test, the
re-plan, P2P and the NCCL abort need two GPUs (with one, a compression hook has nothing to send: its arithmetic on
CUDA tensors with a peer runs only with two; tests/test_gpu_torch.py runs it without Ray). Without CUDA, what runs
instead is what a user then gets from scaling.use_gpu=true: an error naming the field, not a silent CPU run (a
local Ray is given logical GPUs, so the workers are placed and the error comes from them), and which
device each GPU worker would bind and see (the same local Ray: 4 logical GPUs named by UUID).

    python -m benchmarks.device_check         # on a GPU machine: these and every other GPU test
    python -m pytest tests/test_gpu.py -v     # these alone
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist

from raylastic.actors.processes.setup_hook import TRAINS, worker_runtime_env
from raylastic.actors.status.run import RunFailed
from raylastic.cluster.job import train
from raylastic.cluster.local_start import start_local_ray
from raylastic.jobconfig import ScalingConfig
from raylastic.jobconfig.naming import NAMESPACE
from raylastic.strategies.checkpoint import load_into
from raylastic.strategies.device_binding import VISIBLE_DEVICES, assigned_cuda_device_index
from raylastic.strategies.group_assignment import GroupAssignment
from raylastic.strategies.nccl_recovery import ABORT_TIMEOUT_S
from raylastic.strategies.process_group import abort_group, choose_backend, choose_device, join_group
from tests.conftest import REPO_ROOT
from tests.support.helpers import assert_states_close, job, load_model

NUM_GPUS = min(2, torch.cuda.device_count())
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
requires_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason=(
    f"needs 2 CUDA devices, this machine has {torch.cuda.device_count()}" if torch.cuda.is_available()
    else "needs a CUDA device"))
without_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


@without_cuda
def test_use_gpu_without_a_cuda_device_is_an_error_naming_the_field():
    for choose in (choose_device, choose_backend):
        with pytest.raises(ValueError, match=r"scaling\.use_gpu=true, but this worker sees no CUDA device"):
            choose(True)
    assert choose_device(False) == torch.device("cpu") and choose_backend(False) == "gloo"


NODE_GPUS = [f"GPU-5d2f0e1a-0000-4000-8000-00000000000{i}" for i in range(4)]


@pytest.fixture(scope="module")
def ray_with_four_gpus_named_by_uuid(local_ray):
    """A local Ray whose node has 4 logical GPUs and a raylet that sees them by UUID (CUDA_VISIBLE_DEVICES), as on a
    node that names its GPUs: Ray's GPU ids are then the UUIDs. GPU workers are placed, CUDA is absent (without it);
    the module's tests that use it share it."""
    local_ray.stop()
    before = os.environ.get(VISIBLE_DEVICES)
    os.environ[VISIBLE_DEVICES] = ",".join(NODE_GPUS)  # the raylet and its workers inherit it
    try:
        start_local_ray(num_cpus=4, num_gpus=4, namespace=NAMESPACE, include_dashboard=False,
                        logging_level=logging.WARNING, runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    finally:
        if before is None:
            del os.environ[VISIBLE_DEVICES]  # this process's own CUDA must not see the made-up GPUs
        else:
            os.environ[VISIBLE_DEVICES] = before
    try:
        yield
    finally:
        ray.shutdown()


@without_cuda
@pytest.mark.usefixtures("ray_with_four_gpus_named_by_uuid")
def test_a_gpu_job_on_workers_without_cuda_fails_at_once_naming_the_field(tmp_path):
    config = job("scaling.use_gpu=true", "scaling.min_workers=2", "scaling.max_workers=2",
                 "scaling.placement_timeout_s=300", name="nocuda")
    started = time.monotonic()
    with pytest.raises(RunFailed) as raised:
        train(config, run_dir=tmp_path)
    assert "scaling.use_gpu=true, but this worker sees no CUDA device" in str(raised.value)
    # Ray left the workers' CUDA_VISIBLE_DEVICES as the node has it (it narrows it to the actor's GPU by default)
    assert f"{VISIBLE_DEVICES}={','.join(NODE_GPUS)!r}" in str(raised.value)
    assert time.monotonic() - started < config.scaling.placement_timeout_s / 3  # not retried until placement gives up


def _gpu_job(*overrides: str, name: str):
    return job("scaling.use_gpu=true", "scaling.cpus_per_worker=1", f"scaling.min_workers={max(1, NUM_GPUS - 1)}",
               f"scaling.max_workers={NUM_GPUS}", "optim.lr=0.01", *overrides, name=name)


def _saved_scale(checkpoint: str) -> float:
    entries = {"scaler.scale": torch.zeros((), dtype=torch.float64)}
    load_into(entries, checkpoint)
    return entries["scaler.scale"].item()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_gpu_workers_train_with_nccl(tmp_path, record_property, precision):
    record_property("ranks", NUM_GPUS)
    result = train(_gpu_job(f"training.precision={precision}", name=f"gpu-{precision}"), run_dir=tmp_path)
    assert result.final_step == 20 and {row["world_size"] for row in result.history} == {NUM_GPUS}
    losses = [row["loss"] for row in result.history]
    assert all(math.isfinite(loss) for loss in losses) and sum(losses[-3:]) < 0.5 * sum(losses[:3])
    if precision == "fp16":  # the loss scaler's state is part of the checkpoint
        assert _saved_scale(result.checkpoint) > 0


GPU_STRATEGIES = {
    "zero1": ("strategy.name=zero1",),
    "zero2": ("strategy.name=zero2",),
    "zero3": ("strategy.name=zero3",),
    "zero3-offload": ("strategy.name=zero3", "strategy.offload=true"),
    "chargpt-zero2-offload": ("workload.name=chargpt", "workload.options={corpus_chars: 60000, block_size: 32}",
                              "strategy.name=zero2", "strategy.offload=true", "training.precision=bf16"),
    "powersgd": ("strategy.compression=powersgd", "strategy.powersgd_start_iter=2"),
    "topk": ("strategy.compression=topk",),
    "onebit": ("strategy.compression=onebit", "strategy.onebit_warmup_steps=5"),
    "int8": ("strategy.compression=int8",),
    "diloco-bf16": ("strategy.name=diloco", "strategy.sync_every=5", "strategy.compression=bf16"),
    "accumulation": ("training.micro_batch_size=12", "training.precision=bf16"),
}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("overrides", GPU_STRATEGIES.values(), ids=GPU_STRATEGIES.keys())
def test_every_strategy_trains_on_nccl_workers_and_exports_a_cpu_model(tmp_path, record_property, overrides):
    """The comm hooks, FSDP2 and DiLoCo's outer step on CUDA tensors; model.pt loads on a machine without CUDA."""
    record_property("ranks", NUM_GPUS)
    result = train(_gpu_job(*overrides, name="gpu-strategy"), run_dir=tmp_path)
    assert result.final_step == 20 and {row["world_size"] for row in result.history} == {NUM_GPUS}
    losses = [row["loss"] for row in result.history]
    assert all(math.isfinite(loss) for loss in losses) and sum(losses[-3:]) < sum(losses[:3])
    assert {tensor.device.type for tensor in load_model(tmp_path).values()} == {"cpu"}


@pytest.mark.gpu
@requires_two_gpus
@pytest.mark.usefixtures("ray_local")
def test_nccl_survivor_carries_on_when_its_peer_is_killed(tmp_path, record_property):
    """fp16: the replacement receives the survivor's loss scale with the model, so both scale alike."""
    record_property("ranks", 2)
    common = ("training.precision=fp16", "failure.collective_timeout_s=10", "failure.step_timeout_s=10")
    undisturbed = train(_gpu_job(*common, name="nccl-undisturbed"), run_dir=tmp_path / "undisturbed")
    killed = train(_gpu_job(*common, "faults=[{action: kill, rank: 1, step: 8}]", name="nccl-kill"),
                   run_dir=tmp_path / "kill")
    assert killed.final_step == 20
    assert sum(e.type == "worker_failed" for e in killed.events) == 1
    recovered = next(e for e in killed.events if e.type == "recovered")
    assert recovered.details["recovery_s"] < 10 + 10  # the survivor raised in time, it did not die with its peer
    assert_states_close(load_model(tmp_path / "kill"), load_model(tmp_path / "undisturbed"), rtol=1e-3, atol=1e-4)
    assert _saved_scale(killed.checkpoint) == _saved_scale(undisturbed.checkpoint)


TINY_UNTIED_GPT = ("workload.name=chargpt", "workload.options={n_layer: 2, n_head: 2, n_embd: 32, block_size: 16, "
                   "corpus_chars: 30000, tie_embeddings: false}")


@pytest.mark.gpu
@requires_two_gpus
@pytest.mark.usefixtures("ray_local")
def test_a_pp2_run_that_loses_a_gpu_worker_re_plans_onto_its_survivor_from_memory(tmp_path, record_property):
    """A pipeline stage on each of two GPUs; rank 1 is killed at step 6 with no checkpoint written: the survivor
    re-forms alone with the whole model, the lost stage taken from its buddy copy (pinned host memory), no
    committed step lost, and the run finishes."""
    record_property("ranks", 2)
    steps = 16
    result = train(_gpu_job(*TINY_UNTIED_GPT, "parallel.pp=2", "scaling.min_workers=1", "scaling.max_workers=2",
                            f"training.steps={steps}", "training.global_batch_size=8", "checkpoint.every_steps=0",
                            "checkpoint.every_minutes=0", "faults=[{action: kill, rank: 1, step: 6}]",
                            name="gpu-replan"), run_dir=tmp_path)
    formed = [e.details for e in result.events if e.type == "generation_formed"]
    keys = ("layout", "state_source", "previous_layout", "steps_lost")
    assert result.final_step == steps and formed[0]["layout"] == "pp2", formed
    assert tuple(formed[1][key] for key in keys) == ("dp1", "buddy", "pp2", 0), formed
    assert [e.type for e in result.events].count("worker_failed") == 1, result.events
    assert all(math.isfinite(row["loss"]) for row in result.history)


@ray.remote(num_cpus=0.5, num_gpus=1)
class _NcclRank:
    """A GPU worker's device binding and NCCL group, as a TrainWorker makes them."""

    def __init__(self) -> None:
        self.device = choose_device(True)
        self.stores: list[dist.Store] = []
        self._lonely: threading.Thread | None = None
        self._lonely_error: str | None = None

    def seen(self) -> dict:
        return {"index": self.device.index, "count": torch.cuda.device_count(),
                "visible": os.environ.get(VISIBLE_DEVICES), "current": torch.cuda.current_device()}

    def can_access_peer(self, peer_index: int) -> bool:
        return torch.cuda.can_device_access_peer(self.device.index, peer_index)

    def join(self, generation: int, rank: int, store_path: str, timeout_s: float) -> None:
        store = dist.FileStore(store_path, 2)
        self.stores.append(store)
        join_group(GroupAssignment(generation=generation, rank=rank, world_size=2, store=None,
                                   store_prefix="gpu-test", timeout_s=timeout_s), "nccl", store)

    def all_reduce(self) -> float:
        total = torch.full((1 << 20,), float(dist.get_rank() + 1), device=self.device)
        dist.all_reduce(total)
        return total[0].item()

    def start_lonely_all_reduce(self) -> None:
        """An all-reduce its peer never joins, waited for on a thread of its own (as the training thread would)."""
        def run() -> None:
            try:
                self.all_reduce()  # its .item() waits for the kernel, which an abort ends early
                self._lonely_error = "the kernel ended"
            except Exception as error:  # noqa: BLE001 - what the abort makes it raise
                self._lonely_error = f"{type(error).__name__}: {error}"
        self._lonely_error = None
        self._lonely = threading.Thread(target=run, daemon=True)
        self._lonely.start()

    def lonely_end(self, timeout_s: float) -> str | None:
        """How the lonely all-reduce ended (None: still blocked after ``timeout_s``): its error, or "the kernel
        ended" (an aborted communicator's kernel returns early)."""
        self._lonely.join(timeout_s)
        return None if self._lonely.is_alive() else self._lonely_error

    def abort(self) -> None:
        abort_group()

    def group_left(self) -> bool:
        return not dist.is_initialized()


def _nccl_ranks(tmp_path: Path, **worker_env: str) -> list:
    env = worker_runtime_env(ScalingConfig(use_gpu=True, worker_env=dict(worker_env)))
    ranks = [_NcclRank.options(runtime_env=env).remote() for _ in range(2)]
    ray.get([rank.seen.remote() for rank in ranks], timeout=300)
    return ranks


def _join(ranks: list, generation: int, tmp_path: Path, timeout_s: float) -> None:
    store_path = str(tmp_path / f"store-{generation}")
    ray.get([rank.join.remote(generation, index, store_path, timeout_s) for index, rank in enumerate(ranks)],
            timeout=timeout_s + 120)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.usefixtures("ray_local")
def test_a_gpu_worker_binds_the_gpu_ray_assigned_it_and_sees_every_gpu_of_its_node(record_property):
    record_property("ranks", 1)
    rank = _NcclRank.options(runtime_env=worker_runtime_env(ScalingConfig(use_gpu=True))).remote()
    try:
        seen = ray.get(rank.seen.remote(), timeout=300)
        assert seen["current"] == seen["index"] and seen["count"] == torch.cuda.device_count()
        assert seen["visible"] == os.environ.get(VISIBLE_DEVICES)  # as the node has it: Ray did not narrow it
    finally:
        ray.kill(rank)


@pytest.mark.gpu
@requires_two_gpus
@pytest.mark.usefixtures("ray_local")
def test_a_nodes_gpu_workers_bind_their_own_gpu_see_their_peers_and_talk_p2p(tmp_path, record_property):
    record_property("ranks", 2)
    ranks = _nccl_ranks(tmp_path, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P",
                        NCCL_DEBUG_FILE=str(tmp_path / "nccl.%h.%p.log"))
    try:
        seen = ray.get([rank.seen.remote() for rank in ranks])
        assert seen[0]["index"] != seen[1]["index"]
        assert all(s["current"] == s["index"] and s["count"] >= 2 for s in seen)  # each sees its peer's GPU
        _join(ranks, 0, tmp_path, timeout_s=60)
        assert ray.get([rank.all_reduce.remote() for rank in ranks], timeout=120) == [3.0, 3.0]
        if not ray.get(ranks[0].can_access_peer.remote(seen[1]["index"])):
            pytest.skip("these GPUs have no peer access (NVLink or PCIe P2P) to each other")
        log = "".join(path.read_text() for path in tmp_path.glob("nccl.*.log"))
        assert "via P2P" in log and "via SHM" not in log, log[-4000:]
    finally:
        for rank in ranks:
            ray.kill(rank)


@pytest.mark.gpu
@requires_two_gpus
@pytest.mark.usefixtures("ray_local")
def test_an_nccl_collective_whose_peer_stays_away_ends_by_our_abort_and_the_survivor_joins_again(tmp_path,
                                                                                                 record_property):
    """At the group's timeout torch's watchdog records the error and our watch aborts (the watchdog itself aborts
    nothing: TORCH_NCCL_ASYNC_ERROR_HANDLING=0); before it, abort_group does. Either way the process lives on and
    joins the next generation."""
    record_property("ranks", 2)
    ranks = _nccl_ranks(tmp_path)
    survivor = ranks[0]
    try:
        _join(ranks, 0, tmp_path, timeout_s=10)
        assert ray.get([rank.all_reduce.remote() for rank in ranks], timeout=120) == [3.0, 3.0]
        ray.get(survivor.start_lonely_all_reduce.remote())
        ended = ray.get(survivor.lonely_end.remote(10 + ABORT_TIMEOUT_S + 60), timeout=300)
        assert ended is not None, "the watch did not end the collective past its timeout"
        assert ray.get(survivor.group_left.remote())

        _join(ranks, 1, tmp_path, timeout_s=600)  # a timeout the test never reaches: only our abort can end it
        assert ray.get([rank.all_reduce.remote() for rank in ranks], timeout=120) == [3.0, 3.0]
        ray.get(survivor.start_lonely_all_reduce.remote())
        assert ray.get(survivor.lonely_end.remote(2)) is None  # blocked on its peer
        ray.get(survivor.abort.remote(), timeout=ABORT_TIMEOUT_S + 60)
        assert ray.get(survivor.lonely_end.remote(60), timeout=120) is not None
        assert ray.get(survivor.group_left.remote())
    finally:
        for rank in ranks:
            ray.kill(rank)


@ray.remote(num_cpus=0, num_gpus=1)
class _GpuWorkerProbe:
    """Reports what a GPU worker placed here would bind and see, without touching CUDA."""

    def binding(self) -> dict:
        return {"assigned": [str(i) for i in ray.get_gpu_ids()], "visible": os.environ.get(VISIBLE_DEVICES),
                "index": assigned_cuda_device_index(), "nccl_debug": os.environ.get("NCCL_DEBUG")}


@pytest.mark.usefixtures("ray_with_four_gpus_named_by_uuid")
def test_every_gpu_worker_sees_its_nodes_gpus_and_binds_the_one_ray_assigned_it_also_a_replacement():
    """Ray 2.60 narrows a GPU actor's CUDA_VISIBLE_DEVICES to its own GPU unless its process has
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 (worker_runtime_env sets it): then every worker, a replacement
    started after its peers too, sees the node's GPUs and binds its own by position. scaling.worker_env reaches it."""
    environment = worker_runtime_env(ScalingConfig(use_gpu=True, worker_env={"NCCL_DEBUG": "INFO"}))
    probes = [_GpuWorkerProbe.options(runtime_env=environment).remote() for _ in range(3)]
    seen = ray.get([probe.binding.remote() for probe in probes], timeout=300)
    for binding in seen:
        assert binding["visible"] == ",".join(NODE_GPUS)  # all the node's GPUs, its peers' included
        assert binding["index"] == NODE_GPUS.index(binding["assigned"][0])
        assert binding["nccl_debug"] == "INFO"
    assert len({binding["index"] for binding in seen}) == 3

    ray.kill(probes[1])  # a lost worker: its replacement takes the GPU it leaves, or the free one
    replacement = _GpuWorkerProbe.options(runtime_env=environment).remote()
    joined = ray.get(replacement.binding.remote(), timeout=300)
    assert joined["visible"] == ",".join(NODE_GPUS)
    assert joined["index"] not in {seen[0]["index"], seen[2]["index"]}
    assert joined["index"] == NODE_GPUS.index(joined["assigned"][0])

    ray.kill(probes[0])
    narrowed = ray.get(_GpuWorkerProbe.options(runtime_env=TRAINS).remote().binding.remote(), timeout=300)
    assert narrowed["visible"] == narrowed["assigned"][0] and narrowed["index"] == 0  # Ray's default: its GPU only
