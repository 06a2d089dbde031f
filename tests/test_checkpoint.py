"""Checkpoint integrity: damaged or half-written checkpoints are never loaded; the loader falls back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raylastic.strategies.checkpoint import verify_for_load
from raylastic.strategies.checkpoint_catalogue import complete_checkpoints, newest_complete, newest_loadable
from raylastic.strategies.checkpoint_manifest import MANIFEST_NAME, checksum_share
from raylastic.strategies.export import load_full_model_state
from tests.conftest import REPO_ROOT
from tests.support.distributed_harness import run_distributed
from tests.support.strategy_runs import train_with_saves


@pytest.fixture
def two_checkpoints(tmp_path):
    saved = run_distributed(train_with_saves, 2, "zero2", 4, str(tmp_path), 2, timeout_s=120)[0]
    assert saved == [2, 4]
    return tmp_path


def shard_files(directory: str) -> list[Path]:
    return sorted(Path(directory).glob("*.distcp"))


def damage_truncate(directory: str) -> None:
    shard = shard_files(directory)[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def damage_delete(directory: str) -> None:
    shard_files(directory)[-1].unlink()


def damage_flip_a_byte(directory: str) -> None:
    shard = shard_files(directory)[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def damage_remove_manifest(directory: str) -> None:
    (Path(directory) / MANIFEST_NAME).unlink()


@pytest.mark.parametrize(("damage", "reason"), [
    (damage_truncate, "bytes, the manifest says"), (damage_delete, "is missing"),
    (damage_flip_a_byte, "does not match its checksum"), (damage_remove_manifest, None),
])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(two_checkpoints, damage, reason):
    newest = complete_checkpoints(str(two_checkpoints))[-1]
    assert newest.manifest.step == 4 and newest.manifest.world_size == 2 and newest.manifest.strategy == "zero2"
    damage(newest.path)
    found, rejected = newest_loadable(str(two_checkpoints))
    assert found.manifest.step == 2
    if reason is None:  # a directory without a manifest is not even a candidate
        assert rejected == []
    else:
        assert len(rejected) == 1 and reason in rejected[0].reason
    load_full_model_state(found.path)  # the fallback loads


def test_the_head_checks_sizes_and_the_loading_ranks_share_the_checksums(two_checkpoints):
    newest = complete_checkpoints(str(two_checkpoints))[-1]
    damage_flip_a_byte(newest.path)
    assert newest_complete(str(two_checkpoints)) == (newest, [])  # the same size: the head read no data
    shares = [checksum_share(newest.manifest, rank, 2) for rank in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(newest.manifest.files) and all(shares)  # each file once
    assert run_distributed(verify_for_load, 2, newest.path) == [f"{shard_files(newest.path)[0].name} does not match "
                                                                "its checksum"] * 2
    assert run_distributed(verify_for_load, 2, complete_checkpoints(str(two_checkpoints))[0].path) == [None, None]


def test_manifest_records_the_data_cursor_versions_and_checksums(two_checkpoints):
    manifest = json.loads((Path(complete_checkpoints(str(two_checkpoints))[-1].path) / MANIFEST_NAME).read_text())
    assert manifest["samples_consumed"] == 4 * 12 and manifest["config_hash"] == "test"
    assert {"torch", "ray"} <= manifest["versions"].keys()
    assert ".metadata" in manifest["files"] and all(len(f["sha256"]) == 64 for f in manifest["files"].values())


CRASHING_SAVE = """
import os, sys, time, torch, torch.distributed as dist
from raylastic.strategies.checkpoint import Checkpointer
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
checkpointer = Checkpointer(root=sys.argv[1], every_steps=1, num_to_keep=5, config_hash="x", global_batch_size=1,
                            async_save={async_save})
checkpointer.save(1, {{"model.w": torch.zeros(4)}}, strategy="ddp", world_size=1).result()
big = {{f"model.w{{i}}": torch.randn(4_000_000) for i in range(40)}}
checkpointer.save(2, big, strategy="ddp", world_size=1)
print("saving", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("async_save", [True, False])
def test_a_crash_while_saving_leaves_the_previous_checkpoint_loadable(tmp_path, async_save):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = CRASHING_SAVE.format(port=port, async_save=async_save)
    writer = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("step_00000002/*.distcp")) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(writer.pid, signal.SIGKILL)  # mid-write: the shard file exists, the save has not completed
    finally:
        writer.wait()
    assert (tmp_path / "step_00000002").is_dir()
    assert not (tmp_path / "step_00000002" / MANIFEST_NAME).exists()
    found, _ = newest_loadable(str(tmp_path))
    assert found.manifest.step == 1
    assert load_full_model_state(found.path)["w"].shape == (4,)


def test_checkpoint_metadata_that_would_run_code_is_refused(two_checkpoints, tmp_path):
    import pickle

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    newest = complete_checkpoints(str(two_checkpoints))[-1]
    (Path(newest.path) / ".metadata").write_bytes(pickle.dumps(Planted()))
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        _read_metadata(newest.path)
    assert not (tmp_path / "pwned").exists()


def _read_metadata(directory: str):
    from raylastic.strategies.checkpoint_metadata import safe_reader

    return safe_reader(directory).read_metadata()


def test_checkpoints_go_through_fsspec_urls(tmp_path):
    root = f"file://{tmp_path}/remote"
    saved = run_distributed(train_with_saves, 2, "zero3", 2, root, 1, timeout_s=120)[0]
    assert saved == [1, 2]
    found, rejected = newest_loadable(root)
    assert found.path == f"{root}/step_00000002" and rejected == []
    assert load_full_model_state(found.path)
