"""Checkpoints under faults, on real gloo groups and real files: writes that fail, planted files that
would run code, saves over complete checkpoints, pruning across lives of a run, node-local disks."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from raylastic.actors.status.run import RunStatus
from raylastic.strategies.checkpoint import Checkpointer, CheckpointLoadError, load_into
from raylastic.strategies.checkpoint_catalogue import complete_checkpoints, newest_loadable
from raylastic.strategies.checkpoint_manifest import MANIFEST_NAME, read_manifest, verify
from raylastic.strategies.checkpoint_metadata import safe_reader
from raylastic.strategies.export import load_full_model_state
from tests.support.checkpoint_saves import SHARD_VALUES, Saves, replant_manifest, save_steps, sharded_state, step_dirs
from tests.support.distributed_harness import run_distributed

# -- a failed write ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_write_fails_the_save_on_every_rank_naming_the_directory_and_cause(tmp_path, async_save):
    outcomes = run_distributed(save_steps, 2, Saves(str(tmp_path), (1, 2, 3), async_save=async_save, failing_rank=1,
                                                     failing_steps=(2,)), timeout_s=120)
    for rank_outcomes in outcomes:
        first, failed, third = rank_outcomes
        assert first.startswith("ok") and third.startswith("ok"), rank_outcomes  # the group is still in step
        assert failed.startswith("CheckpointWriteError"), failed  # not "hung": DCP's error is a BaseException
        assert f"could not write checkpoint {tmp_path}/step_00000002: rank 1: " in failed
    assert not (tmp_path / "step_00000002" / MANIFEST_NAME).exists()
    assert newest_loadable(str(tmp_path))[0].manifest.step == 3


@pytest.mark.parametrize("async_save", [True, False])
def test_the_files_each_rank_wrote_are_read_off_the_directory_not_dcps_returned_metadata(tmp_path, async_save):
    """torch 2.11's save returned its metadata without storage_data: every save failed on an AttributeError."""
    outcomes = run_distributed(save_steps, 2, Saves(str(tmp_path), (1,), async_save=async_save, bare_dcp_result=True),
                               timeout_s=120)
    assert all(rank_outcomes[0].startswith("ok") for rank_outcomes in outcomes), outcomes
    directory = str(tmp_path / "step_00000001")
    listed = read_manifest(directory).files
    assert {name for name in listed if name.endswith(".distcp")} == {p.name for p in Path(directory).glob("*.distcp")}
    assert {name[:3] for name in listed if name.endswith(".distcp")} == {"__0", "__1"}
    assert verify(directory, read_manifest(directory)) is None


def test_a_checkpoint_directory_that_cannot_be_made_fails_every_rank_at_once(tmp_path):
    root = tmp_path / "checkpoints"
    root.write_text("a file where the checkpoint directory should be")
    group_timeout_s = 120
    outcomes = run_distributed(save_steps, 2, Saves(str(root), (1,)), timeout_s=group_timeout_s)
    for (failed,) in outcomes:  # rank 1 learns it from rank 0 instead of waiting out the group's timeout
        assert failed.startswith("CheckpointWriteError after "), failed
        assert float(failed.split()[2]) < group_timeout_s / 3, failed
        assert f"could not write checkpoint {root}/step_00000001: " in failed and "NotADirectoryError" in failed


# -- planted files that would run code -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    assert all(o.startswith("ok") for o in run_distributed(save_steps, 2, Saves(str(root), (1, 2)), timeout_s=120)[0])
    return root


@pytest.fixture
def planted(saved, tmp_path):
    """A copy of ``saved`` whose step 2 an attacker may change, and the marker file their code would create."""
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    return root, tmp_path / "code-ran"


def global_call(module: str, name: str, argument: str) -> bytes:
    """A protocol-4 pickle that calls ``module``'s ``name`` (a dotted name resolves attribute by attribute,
    STACK_GLOBAL) with ``argument``."""
    def text(value: str) -> bytes:
        encoded = value.encode()
        return b"\x8c" + bytes([len(encoded)]) + encoded  # SHORT_BINUNICODE

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(argument) + b"\x85R."  # TUPLE1 REDUCE STOP


class RunsCode:
    """Unpickling it runs ``command``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return (os.system, (self.command,))


def test_metadata_naming_a_dotted_global_is_refused_and_runs_nothing(planted):
    root, marker = planted
    payload = global_call("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}")
    pickle.loads(payload)  # the payload is live: DCP's module imports os, and plain pickle reaches os.system
    assert marker.exists()
    marker.unlink()

    newest = root / "step_00000002"
    (newest / ".metadata").write_bytes(payload)
    replant_manifest(newest)
    found, rejected = newest_loadable(str(root))
    assert found.manifest.step == 1  # the planted one is passed over, not a crash of the run
    assert [r.path for r in rejected] == [str(newest)]
    assert "torch.distributed.checkpoint.metadata.os.system, which is not allowed" in rejected[0].reason
    with pytest.raises(pickle.UnpicklingError, match="os.system, which is not allowed"):
        safe_reader(str(newest)).read_metadata()
    assert not marker.exists()


def test_metadata_storing_an_entry_as_pickled_bytes_is_refused_and_runs_nothing(planted):
    root, marker = planted
    newest = root / "step_00000002"
    metadata = safe_reader(str(newest)).read_metadata()
    metadata.state_dict_metadata["model.w"] = BytesStorageMetadata()  # DCP would torch.load(weights_only=False) it
    planted_bytes = _torch_saved(RunsCode(f"touch {marker}"))
    (newest / "__9_0.distcp").write_bytes(planted_bytes)
    metadata.storage_data = {MetadataIndex("model.w"): _StorageInfo("__9_0.distcp", 0, len(planted_bytes))}
    (newest / ".metadata").write_bytes(pickle.dumps(metadata))
    replant_manifest(newest)

    dcp.load({"model.w": torch.zeros(SHARD_VALUES)}, storage_reader=FileSystemReader(str(newest)), no_dist=True)
    assert marker.exists()  # the attack is live against DCP's own reader
    marker.unlink()

    found, rejected = newest_loadable(str(root))
    assert found.manifest.step == 1 and len(rejected) == 1
    assert "stores 'model.w' as pickled bytes" in rejected[0].reason
    with pytest.raises(CheckpointLoadError, match="stores 'model.w' as pickled bytes"):
        load_into({"model.w": torch.zeros(SHARD_VALUES)}, str(newest))  # a path handed over unverified, too
    with pytest.raises(ValueError, match="pickled bytes"):
        load_full_model_state(str(newest))
    assert not marker.exists()


def _torch_saved(value: object) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_state_that_is_not_tensors_is_refused_before_anything_is_written(tmp_path):
    checkpointer = Checkpointer(root=str(tmp_path), every_steps=1, num_to_keep=1, config_hash="job",
                                global_batch_size=1)
    with pytest.raises(ValueError, match="'optim.state.w.step' is of type int; only tensors are saved"):
        checkpointer.save(1, {"model.w": torch.zeros(2), "optim.state.w.step": 3}, strategy="ddp", world_size=1)
    assert list(tmp_path.iterdir()) == []


# -- saving over complete checkpoints, and pruning ------------------------------------------------------------


def test_saving_a_step_whose_checkpoint_is_complete_keeps_that_checkpoint(tmp_path):
    run_distributed(save_steps, 1, Saves(str(tmp_path), (5,)), timeout_s=60)
    before = read_manifest(str(tmp_path / "step_00000005"))
    # A finished run run again saves its last step again; this time every write would fail.
    (again,) = run_distributed(save_steps, 1, Saves(str(tmp_path), (5,), failing_rank=0, failing_steps=(5,)))[0]
    assert again == f"ok {tmp_path}/step_00000005"
    found, _ = newest_loadable(str(tmp_path))
    assert found.manifest == before  # not deleted to be written again

    shard = next((tmp_path / "step_00000005").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # damaged: that one is written anew
    assert run_distributed(save_steps, 1, Saves(str(tmp_path), (5,)))[0][0].startswith("ok")
    found, rejected = newest_loadable(str(tmp_path))
    assert found.manifest.step == 5 and found.manifest.created_at > before.created_at and rejected == []


def test_a_complete_checkpoint_of_another_job_at_the_same_step_is_not_overwritten(tmp_path):
    run_distributed(save_steps, 1, Saves(str(tmp_path), (5,), config_hash="other"))
    (outcome,) = run_distributed(save_steps, 1, Saves(str(tmp_path), (5,)))[0]
    assert outcome.startswith("CheckpointWriteError") and "complete checkpoint of another job" in outcome
    assert newest_loadable(str(tmp_path))[0].manifest.config_hash == "other"


def test_pruning_never_removes_what_a_run_restarted_from_an_older_step_just_wrote(tmp_path):
    root = str(tmp_path)
    run_distributed(save_steps, 1, Saves(root, (10, 20, 30), num_to_keep=1))
    assert step_dirs(tmp_path) == ["step_00000030"]
    # A later life of the run went on from step 10 (say step 30 was unreadable then): its checkpoints are
    # not "older" than step 30 because their steps are lower.
    run_distributed(save_steps, 1, Saves(root, (15,), num_to_keep=1))
    assert step_dirs(tmp_path) == ["step_00000015", "step_00000030"]
    run_distributed(save_steps, 1, Saves(root, (25,), num_to_keep=1))
    assert step_dirs(tmp_path) == ["step_00000025", "step_00000030"]  # 15 is superseded by 25
    assert [c.manifest.step for c in complete_checkpoints(str(tmp_path))] == [25, 30]


# -- node-local disks ----------------------------------------------------------------------------------------


def save_on_node_local_disks(base: str, async_save: bool) -> str:
    """Each rank in a directory of its own, as on a node with its own disk: the same relative root is
    another place for every rank."""
    node = Path(base) / f"node{dist.get_rank()}"
    node.mkdir()
    os.chdir(node)
    checkpointer = Checkpointer(root="checkpoints", every_steps=1, num_to_keep=2, config_hash="job",
                                global_batch_size=1, async_save=async_save)
    return checkpointer.save(1, sharded_state(), strategy="zero3", world_size=2).result(timeout=60)


@pytest.mark.parametrize("async_save", [False, True])
def test_the_manifest_lists_the_files_every_rank_wrote_on_its_own_disk(tmp_path, async_save):
    run_distributed(save_on_node_local_disks, 2, str(tmp_path), async_save, timeout_s=120)
    on_node = [tmp_path / f"node{rank}" / "checkpoints" / "step_00000001" for rank in (0, 1)]
    assert sorted(p.name for p in on_node[1].iterdir()) == ["__1_0.distcp"]  # rank 1 wrote only there
    manifest = read_manifest(str(on_node[0]))
    assert sorted(manifest.files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for name, entry in manifest.files.items():
        written = on_node[1] / name if name == "__1_0.distcp" else on_node[0] / name
        assert entry["size"] == written.stat().st_size
    assert verify(str(on_node[0]), manifest) == "__1_0.distcp is missing"  # node 0 alone cannot load it
    shutil.copy(on_node[1] / "__1_0.distcp", on_node[0])  # the files brought together, as on shared storage
    assert verify(str(on_node[0]), manifest) is None
    assert torch.equal(load_full_model_state(str(on_node[0]))["w"], torch.arange(float(SHARD_VALUES)))


# -- in a real run -------------------------------------------------------------------------------------------


def block_with_a_file(root: Path) -> None:
    root.rename(root.with_name("checkpoints.before"))
    root.write_text("a file where the checkpoint directory was")


def make_read_only(root: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    root.chmod(0o500)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize(("block", "cause"), [(block_with_a_file, "NotADirectoryError"),
                                              (make_read_only, "PermissionError")])
def test_a_checkpoint_path_that_stops_taking_files_mid_run_ends_it_naming_path_and_cause(tmp_path, block, cause):
    from raylastic.actors.status.run import RunFailed
    from raylastic.cluster.job import train
    from tests.support.helpers import job

    if block is make_read_only:
        make_read_only(tmp_path)  # skips before a run is started for nothing
    run_dir, blocked = tmp_path / "run", {}

    def after_the_first_checkpoint(progress: RunStatus) -> None:
        if not blocked and any(e.type == "checkpointed" for e in progress.events):
            block(run_dir / "checkpoints")
            blocked.update(step=progress.step, at=time.monotonic())

    # ~0.6 s a step: the first save is long done before the second is due
    collective_timeout_s = 120
    config = job("workload.name=tests.support.user_workload:SlowDigits", "workload.options={pause_s: 0.2}",
                 "training.micro_batch_size=8", "checkpoint.every_steps=5",
                 f"failure.collective_timeout_s={collective_timeout_s}", name="unwritable-later")
    with pytest.raises(RunFailed) as raised:
        train(config, run_dir=run_dir, on_progress=after_the_first_checkpoint)
    ended = time.monotonic()
    assert blocked and blocked["step"] < 10
    message = str(raised.value)
    assert f"could not write checkpoint {run_dir / 'checkpoints'}/step_000000" in message and cause in message
    saved = json.loads((run_dir / "result.json").read_text())
    assert saved["status"] == "failed" and "could not write checkpoint" in saved["error"]
    assert ended - blocked["at"] < collective_timeout_s / 3  # no collective waited out its timeout, nothing hung
