"""Files in a checkpoint directory that are not what the manifest says, and files of the user's that are
never deleted: planted manifests naming files outside their directory, named pipes, symbolic links out,
and a user's own files beside (or inside ``step_*`` directories among) the checkpoints.

    python -m pytest tests/test_checkpoint_files.py -q
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from raylastic.cluster.cli import main as cli_main
from raylastic.strategies.checkpoint_catalogue import complete_checkpoints, newest_loadable
from raylastic.strategies.checkpoint_manifest import MANIFEST_NAME, MARKER_NAME, read_manifest, verify
from raylastic.strategies.export import load_full_model_state
from tests.support.checkpoint_saves import Saves, save_steps, step_dirs
from tests.support.distributed_harness import run_distributed

GUARD_S = 60
"""How long a check may take before the test calls it blocked: far more than the milliseconds it takes."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    assert all(o.startswith("ok") for o in run_distributed(save_steps, 1, Saves(str(root), (1, 2)))[0])
    return root


@pytest.fixture
def planted(saved, tmp_path):
    """A copy of ``saved`` whose step 2 an attacker may change: (root, step 2's directory)."""
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    return root, root / "step_00000002"


def list_in_manifest(directory: Path, name: str, content: bytes) -> None:
    """Add ``name`` to ``directory``'s manifest with ``content``'s size and checksum."""
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest["files"][name] = {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def within_guard(call: Callable[[], Any], fifos: list[Path]) -> Any:
    """``call()``'s result (or the exception it raised), or "blocked" if it has not returned after GUARD_S;
    a reader blocked on one of ``fifos`` is then let go (a writer opens and closes it: end of file)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as error:  # noqa: BLE001 - the test looks at it
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(GUARD_S)
    if thread.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(GUARD_S)
        return "blocked"
    return outcome[0]


# -- names outside the directory ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../outside.bin", "sub/../../outside.bin", "absolute"])
def test_a_manifest_naming_a_file_outside_its_directory_is_refused(planted, name):
    root, newest = planted
    content = b"not the checkpoint's to read"
    (root / "outside.bin").write_bytes(content)
    name = str(root / "outside.bin") if name == "absolute" else name
    list_in_manifest(newest, name, content)  # its checksum matches: only the name gives it away

    found, rejected = newest_loadable(str(root))
    assert found.manifest.step == 1 and [r.path for r in rejected] == [str(newest)]
    assert f"{name!r} is not a plain file name in the checkpoint directory" in rejected[0].reason
    with pytest.raises(ValueError, match="is not a plain file name in the checkpoint directory"):
        load_full_model_state(str(newest))


# -- files that are not regular files -------------------------------------------------------------------------


def test_a_named_pipe_listed_in_the_manifest_is_refused_without_being_opened(planted, capsys):
    root, newest = planted
    os.mkfifo(newest / "pipe")
    list_in_manifest(newest, "pipe", b"")  # a reader that opened it would wait for a writer forever

    outcome = within_guard(lambda: newest_loadable(str(root)), [newest / "pipe"])
    assert outcome != "blocked"
    found, rejected = outcome
    assert found.manifest.step == 1
    assert rejected[0].reason == "pipe is a named pipe (FIFO), not a regular file"
    code = within_guard(lambda: cli_main(["export", str(newest), str(root / "model.pt")]), [newest / "pipe"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "pipe is a named pipe (FIFO), not a regular file" in err
    assert not (root / "model.pt").exists()


def test_a_named_pipe_in_place_of_the_manifest_is_passed_over_without_being_opened(planted, capsys):
    root, newest = planted
    (newest / MANIFEST_NAME).unlink()
    os.mkfifo(newest / MANIFEST_NAME)

    found = within_guard(lambda: complete_checkpoints(str(root)), [newest / MANIFEST_NAME])
    assert found != "blocked" and [c.manifest.step for c in found] == [1]
    code = within_guard(lambda: cli_main(["export", str(newest), str(root / "model.pt")]), [newest / MANIFEST_NAME])
    assert code == 1
    assert f"not a complete checkpoint: {MANIFEST_NAME} is a named pipe (FIFO)" in capsys.readouterr().err


def test_a_symbolic_link_out_of_the_directory_is_refused_and_one_inside_it_is_read(planted):
    root, newest = planted
    shard = next(newest.glob("*.distcp"))
    moved = root / "elsewhere.distcp"
    shard.rename(moved)
    shard.symlink_to(moved)
    manifest = read_manifest(str(newest))
    expected = f"{shard.name} is a symbolic link out of the checkpoint directory (to {moved})"
    assert verify(str(newest), manifest) == expected

    shard.unlink()
    moved.rename(newest / "kept.bin")
    shard.symlink_to("kept.bin")  # relative, inside the directory: the file it names is checked as itself
    assert verify(str(newest), manifest) is None


# -- nothing of the user's deleted ----------------------------------------------------------------------------


def test_pruning_deletes_only_directories_we_wrote(tmp_path):
    """A user's files among the checkpoints, even in ``step_*`` names, survive every prune; our own
    incomplete directory (a save that failed) and superseded checkpoints do not."""
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "step_00000002" / "notes.txt").write_text("the user's")
    (tmp_path / "step_00000003").write_text("the user's file")
    (tmp_path / "step_00000004").mkdir()  # empty, and not ours either
    (tmp_path / "notes.txt").write_text("the user's")

    outcomes = run_distributed(save_steps, 1, Saves(str(tmp_path), (1, 5, 6, 7), num_to_keep=1, failing_rank=0,
                                                     failing_steps=(5,)))[0]
    assert [o.split()[0] for o in outcomes] == ["ok", "CheckpointWriteError", "ok", "ok"], outcomes
    assert step_dirs(tmp_path) == ["step_00000002", "step_00000003", "step_00000004", "step_00000007"]
    assert (tmp_path / "step_00000002" / "notes.txt").read_text() == "the user's"
    assert (tmp_path / "step_00000003").read_text() == "the user's file"
    assert (tmp_path / "notes.txt").read_text() == "the user's"
    assert (tmp_path / "step_00000007" / MARKER_NAME).is_file()


def test_a_save_into_a_step_directory_holding_a_users_files_fails_and_deletes_nothing(tmp_path):
    (tmp_path / "step_00000005").mkdir()
    (tmp_path / "step_00000005" / "notes.txt").write_text("the user's")
    (tmp_path / "step_00000006").mkdir()  # empty: nothing to lose, so it is written into

    failed, written = run_distributed(save_steps, 1, Saves(str(tmp_path), (5, 6)))[0]
    assert failed.startswith("CheckpointWriteError") and f"could not write checkpoint {tmp_path}/step_00000005: " \
        f"it holds files that Raylastic did not write (it has no {MARKER_NAME} and no manifest)" in failed
    assert "checkpoint.path" in failed
    assert sorted(p.name for p in (tmp_path / "step_00000005").iterdir()) == ["notes.txt"]
    assert written == f"ok {tmp_path}/step_00000006"


def test_a_checkpoint_complete_before_the_marker_existed_is_still_ours_to_prune(tmp_path):
    run_distributed(save_steps, 1, Saves(str(tmp_path), (1,)))
    (tmp_path / "step_00000001" / MARKER_NAME).unlink()  # as a checkpoint written before markers were
    run_distributed(save_steps, 1, Saves(str(tmp_path), (2, 3), num_to_keep=1))
    assert step_dirs(tmp_path) == ["step_00000003"]


def test_on_an_fsspec_store_names_and_file_types_are_checked_and_only_our_directories_pruned():
    import uuid

    import fsspec

    from raylastic.strategies.checkpoint_catalogue import prune_checkpoints
    from raylastic.strategies.checkpoint_manifest import CheckpointManifest, checksums, file_problem, write_manifest

    fs, root = fsspec.filesystem("memory"), f"memory://checkpoints-{uuid.uuid4().hex}"
    fs.pipe(f"{root}/step_00000001/notes.txt", b"the user's")
    fs.pipe(f"{root}/step_00000002/{MARKER_NAME}", b"")  # ours: a save that never completed
    for step in (3, 4):
        fs.pipe(f"{root}/step_0000000{step}/a.bin", b"state")
        write_manifest(f"{root}/step_0000000{step}", CheckpointManifest(
            step=step, world_size=1, strategy="ddp", samples_consumed=step, config_hash="job"),
            files=checksums(f"{root}/step_0000000{step}", ["a.bin"]))
    prune_checkpoints(root, 1, written_step=4)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == ["step_00000001", "step_00000004"]
    assert fs.cat(f"{root}/step_00000001/notes.txt") == b"the user's"

    newest = f"{root}/step_00000004"
    assert file_problem(newest, "../step_00000001/notes.txt").startswith("'../step_00000001/notes.txt' is not a plain")
    fs.pipe(f"{newest}/sub/a.bin", b"state")
    assert file_problem(newest, "sub") == "sub is not a regular file (fsspec type 'directory')"
    assert file_problem(newest, "gone.bin") == "gone.bin is missing" and file_problem(newest, "a.bin") is None


def test_pruning_keeps_and_deletes_by_the_same_step_the_manifests(tmp_path):
    """Pruning kept by the manifest's step and deleted by the directory name's: a checkpoint whose manifest says a
    later step than its name (one copied in by hand) was deleted though newer than the one just written, and one
    whose name says a later step than its manifest was kept beyond checkpoint.num_to_keep."""
    from raylastic.strategies.checkpoint_catalogue import prune_checkpoints
    from raylastic.strategies.checkpoint_manifest import CheckpointManifest, write_manifest, write_marker

    for name, step in (("step_00000001", 1), ("step_00000002", 9), ("step_00000004", 4), ("step_00000007", 2)):
        (tmp_path / name).mkdir()
        write_marker(str(tmp_path / name))
        write_manifest(str(tmp_path / name), CheckpointManifest(step=step, world_size=1, strategy="ddp",
                                                                 samples_consumed=step, config_hash="job"), files={})
    prune_checkpoints(str(tmp_path), 1, written_step=4)
    assert step_dirs(tmp_path) == ["step_00000002", "step_00000004"]
