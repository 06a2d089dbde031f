"""The parameter servers' checkpoints (actors/async_ps/checkpoints.py, saver.py), on real files: whole cuts of one
lineage only, clearing and pruning only our own files, restores that check what they read, saves written on
the saver's thread while the server goes on; and the model the servers' shares make, exported from a cut."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from raylastic.actors.async_ps.checkpoints import Cut, clear_after, complete_checkpoints, newest_complete, prune
from raylastic.actors.async_ps.saver import SaveStillWriting
from raylastic.actors.async_ps.server import ParameterServer, UnreadableCheckpoint
from raylastic.actors.async_ps.shards import assign_parameters, merged_shares, model_from_shares
from raylastic.cluster.cli import main as cli_main
from raylastic.jobconfig import WorkloadConfig
from raylastic.workloads import load_workload
from tests.support.helpers import assert_states_close
from tests.test_async_ps import digits_names, gradients_of, server_spec, wait_written


def plant(root: Path, files: dict[str, str]) -> None:
    """Files at these paths under ``root``, with these contents."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def listing(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


def test_a_cut_is_whole_only_with_every_servers_file_of_one_lineage(tmp_path):
    """Issue 29: 'complete' meant every server_i file exists, so files of two epochs at one version made a cut."""
    plant(tmp_path, dict.fromkeys([
        "ps_00000005/server_0_of_1.pt",                                             # before lineages: one of its own
        "ps_00000010/server_0_of_2.0a.pt", "ps_00000010/server_1_of_2.0a.pt",      # whole
        "ps_00000020/server_0_of_2.0a.pt", "ps_00000020/server_1_of_2.0b.pt",      # two epochs: torn
        "ps_00000030/server_0_of_2.0b.pt", "ps_00000030/server_1_of_2.0b.pt.tmp",  # one still being written
        "ps_00000040/server_0_of_2.0a.pt", "ps_00000040/server_1_of_2.0a.pt",      # whole twice: the newer epoch's
        "ps_00000040/server_0_of_2.0b.pt", "ps_00000040/server_1_of_2.0b.pt",
        "ps_00000050/server_0_of_3.0b.pt", "ps_00000050/server_1_of_3.0b.pt"], ""))  # one of three missing
    root = str(tmp_path)
    assert complete_checkpoints(root) == [Cut(f"{root}/ps_00000005", 5, "", 1),
                                          Cut(f"{root}/ps_00000010", 10, "0a", 2),
                                          Cut(f"{root}/ps_00000040", 40, "0b", 2)]
    assert newest_complete(root, excluding=frozenset({Cut(f"{root}/ps_00000040", 40, "0b", 2)})).version == 10
    assert Cut(f"{root}/ps_00000040", 40, "0b", 2).files() == [f"{root}/ps_00000040/server_0_of_2.0b.pt",
                                                                f"{root}/ps_00000040/server_1_of_2.0b.pt"]


def test_clearing_and_pruning_delete_only_our_files(tmp_path):
    """A restore to version 20 clears the abandoned timeline after it; pruning keeps the newest whole cuts and
    clears older directories; a user's file - in a directory of ours, or named like one - is never touched."""
    plant(tmp_path, {"ps_00000010/server_0_of_1.0a.pt": "", "ps_00000020/server_0_of_1.0a.pt": "",
                     "ps_00000015/server_0_of_2.0a.pt": "",                        # never whole: server 1 skipped it
                     "ps_00000030/server_0_of_1.0a.pt": "", "ps_00000040/server_0_of_1.0a.pt.tmp": "",
                     "ps_00000040/notes.txt": "mine", "ps_00000050/server_0_of_1.0a.pt": "",
                     "ps_00000060": "a file of the user's", "ps_notes/server_0_of_1.0a.pt": ""})
    clear_after(str(tmp_path), 20)
    assert listing(tmp_path) == ["ps_00000010/server_0_of_1.0a.pt", "ps_00000015/server_0_of_2.0a.pt",
                                 "ps_00000020/server_0_of_1.0a.pt", "ps_00000040/notes.txt", "ps_00000060",
                                 "ps_notes/server_0_of_1.0a.pt"]
    assert not (tmp_path / "ps_00000030").exists() and not (tmp_path / "ps_00000050").exists()
    plant(tmp_path, {"ps_00000030/server_0_of_1.0b.pt": "", "ps_00000035/server_0_of_1.0b.pt.tmp": ""})
    prune(str(tmp_path), keep=2)
    assert listing(tmp_path) == ["ps_00000020/server_0_of_1.0a.pt", "ps_00000030/server_0_of_1.0b.pt",
                                 "ps_00000035/server_0_of_1.0b.pt.tmp",            # newer than the newest cut
                                 "ps_00000040/notes.txt", "ps_00000060", "ps_notes/server_0_of_1.0a.pt"]


def saved_server(tmp_path: Path, lineage: str = "0a") -> ParameterServer:
    """A server that applied two updates and wrote version 2 (every_steps=2) as ``lineage``."""
    server = ParameterServer(server_spec(tmp_path, every_steps=2), index=0, names=digits_names())
    server.restore(1, None, lineage)
    for update in (1, 2):
        server.push(1, update, update - 1, gradients_of(server, 0.1), {}, ticket=update - 1)
    wait_written(server, 2)
    return server


def test_a_restore_refuses_a_file_that_is_not_what_its_name_says(tmp_path):
    saved_server(tmp_path)
    cut = newest_complete(str(tmp_path))
    fresh = ParameterServer(server_spec(tmp_path), index=0, names=digits_names())
    assert fresh.restore(2, cut, "0b").version == 2
    renamed = Path(cut.directory).with_name("ps_00000004")     # version 2's file under version 4's name
    Path(cut.directory).rename(renamed)
    with pytest.raises(UnreadableCheckpoint, match=r"server_0_of_1\.0a\.pt holds version 2 of lineage '0a', not"):
        fresh.restore(3, newest_complete(str(tmp_path)), "0c")
    (renamed / "server_0_of_1.0a.pt").write_bytes(b"truncated")
    with pytest.raises(UnreadableCheckpoint, match=r"ps_00000004/server_0_of_1\.0a\.pt could not be read"):
        fresh.restore(4, newest_complete(str(tmp_path)), "0d")


def test_a_save_slower_than_the_heartbeats_does_not_hold_the_server_up(tmp_path):
    """Issue 29: a server wrote its checkpoint inside ``push``, on its only thread: a slow disk made it miss
    heartbeats and get killed. A FIFO in place of the file makes the write wait for a reader."""
    server = ParameterServer(server_spec(tmp_path, every_steps=2), index=0, names=digits_names())
    server.restore(1, None, "0a")
    fifo = tmp_path / "ps_00000002" / "server_0_of_1.0a.pt.tmp"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    pushed = threading.Event()

    def push_three() -> None:
        for update in (1, 2, 3):
            server.push(1, update, update - 1, gradients_of(server, 0.1), {}, ticket=update - 1)
        pushed.set()

    threading.Thread(target=push_three, daemon=True).start()
    try:
        assert pushed.wait(timeout=120), "a push waited for the checkpoint write"
        beat = server.beat()
        assert (beat.version, beat.written) == (3, 0)
    finally:
        with open(fifo, "rb") as reader:  # let the write through (or, without the fix, the blocked push)
            reader.read()
    wait_written(server, 2)


def test_a_restore_waits_for_a_stuck_save_only_its_bound_and_names_the_file(tmp_path):
    """A save stuck on its disk (a FIFO with no reader in place of the file) held a restore without end."""
    spec = dataclasses.replace(server_spec(tmp_path, every_steps=2), save_wait_s=2)
    server = ParameterServer(spec, index=0, names=digits_names())
    server.restore(1, None, "0a")
    fifo = tmp_path / "ps_00000002" / "server_0_of_1.0a.pt.tmp"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    for update in (1, 2):
        server.push(1, update, update - 1, gradients_of(server, 0.1), {}, ticket=update - 1)
    deadline = time.monotonic() + 60
    while server.saver.writing != 2:  # a save still waiting would only be dropped
        assert time.monotonic() < deadline, "the save of version 2 did not start in 60 s"
        time.sleep(0.01)
    restoring: dict[str, object] = {}

    def restore() -> None:
        try:
            server.restore(2, None, "0b")
            restoring["ended"] = "restored"
        except SaveStillWriting as error:
            restoring["ended"] = error

    thread = threading.Thread(target=restore, daemon=True)
    thread.start()
    thread.join(timeout=60)
    try:
        assert not thread.is_alive(), "the restore still waits for the stuck save after 60 s"
        assert isinstance(restoring["ended"], SaveStillWriting)
        assert "version 2 to" in str(restoring["ended"]) and "server_0_of_1.0a.pt" in str(restoring["ended"])
    finally:
        with open(fifo, "rb") as reader:  # let the write through (and, without the fix, the restore)
            reader.read()


def test_a_failed_save_is_reported_at_the_next_heartbeat_and_the_server_goes_on(tmp_path):
    (tmp_path / "ps_00000002").write_text("a file where the directory goes")
    server = ParameterServer(server_spec(tmp_path, every_steps=2), index=0, names=digits_names())
    server.restore(1, None, "0a")
    for update in (1, 2, 3):
        server.push(1, update, update - 1, gradients_of(server, 0.1), {}, ticket=update - 1)
    deadline, failed = time.monotonic() + 120, ()
    while not failed:
        assert time.monotonic() < deadline, "no failed save was reported in 120 s"
        beat = server.beat()
        failed = beat.failed_saves
        time.sleep(0.01)
    assert beat.version == 3 and beat.written == 0
    assert [(f.version, f.path) for f in failed] == [(2, f"{tmp_path}/ps_00000002/server_0_of_1.0a.pt")]
    assert failed[0].error.split(":")[0] in ("FileExistsError", "NotADirectoryError")
    assert server.beat().failed_saves == ()                      # reported once
    assert torch.equal(server.state()["0.weight"], server.params["0.weight"])


def test_the_servers_shares_make_a_model_whose_lm_head_shares_the_embeddings_weight(tmp_path):
    """chargpt ties its lm head to the token embedding: named_parameters, which the shards and the servers follow,
    names that weight once, and the model built from the servers' shares (evaluations, the final model) gets it
    under both names."""
    options = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8, "corpus_chars": 20000}
    workload = load_workload("chargpt", options)
    tied = workload.build_model()
    sizes = {name: p.numel() for name, p in tied.named_parameters()}
    assert "lm_head.weight" in tied.state_dict() and "lm_head.weight" not in sizes
    spec = dataclasses.replace(server_spec(tmp_path, num_servers=2),
                               workload=WorkloadConfig(name="chargpt", options=options))
    servers = [ParameterServer(spec, index=i, names=shard) for i, shard in enumerate(assign_parameters(sizes, 2))]
    for server in servers:
        server.push(0, 1, 0, gradients_of(server, 0.5), {}, ticket=0)
    shares = merged_shares(server.state() for server in servers)
    model = model_from_shares(workload, shares)
    assert model.lm_head.weight is model.wte.weight
    assert_states_close(dict(model.named_parameters()), {name: shares[name] for name in sizes}, rtol=0, atol=0)
    assert not torch.equal(model.wte.weight, tied.wte.weight)  # the update reached it


def test_raylastic_export_writes_a_parameter_server_checkpoint_as_a_model_file_with_its_tied_weights(tmp_path, capsys):
    options = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8, "corpus_chars": 20000}
    workload = load_workload("chargpt", options)
    sizes = {name: p.numel() for name, p in workload.build_model().named_parameters()}
    spec = dataclasses.replace(server_spec(tmp_path, num_servers=2, every_steps=1),
                               workload=WorkloadConfig(name="chargpt", options=options))
    servers = [ParameterServer(spec, index=i, names=shard) for i, shard in enumerate(assign_parameters(sizes, 2))]
    for server in servers:
        server.restore(1, None, "0a")
        server.push(1, 1, 0, gradients_of(server, 0.5), {}, ticket=0)
        wait_written(server, 1)
    cut = newest_complete(str(tmp_path))
    assert cli_main(["export", cut.directory, str(tmp_path / "model.pt")]) == 0, capsys.readouterr().err
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    model = workload.build_model()
    model.load_state_dict(exported)  # strict: every name, the tied lm head's too
    shares = merged_shares(server.state() for server in servers)
    assert_states_close(dict(model.named_parameters()), {name: shares[name] for name in sizes}, rtol=0, atol=0)

    os.remove(cut.files()[1])  # a directory missing a server's file is refused, naming what it holds
    assert cli_main(["export", cut.directory, str(tmp_path / "again.pt")]) == 1
    assert "is not a whole parameter-server checkpoint" in capsys.readouterr().err.replace("\n", "")
