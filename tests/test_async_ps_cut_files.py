"""A parameter-server cut's files are checked before and after they are read (actors/async_ps/server_files.py), on
real files: a named pipe, a link out of the directory, a directory, a file that is not a server's dict or lacks its
parameters, a tie to a weight no file holds. ``raylastic export`` fails naming the file and what is wrong (it hung
on a FIFO, or ended in a KeyError/TypeError traceback); a server's restore refuses it as UnreadableCheckpoint, which
sends the Controller to an older cut (it waited on a FIFO until the restore timed out, again and again)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from raylastic.actors.async_ps.checkpoints import newest_complete
from raylastic.actors.async_ps.server import ParameterServer, UnreadableCheckpoint
from raylastic.cluster.cli import main as cli_main
from tests.test_async_ps import digits_names, server_spec
from tests.test_async_ps_checkpoints import saved_server

BOUND_S = 120


def server_file(**changes) -> dict:
    """What a server writes (``ParameterServer._submit_save``), with ``changes``."""
    return {"config_hash": "h", "version": 3, "lineage": "0a", "tickets": [0, 1, 2],
            "params": {"w": torch.arange(4.0)}, "optimizer": {"state": {}, "param_groups": []},
            "prediction": {}, "tied": {"head.w": "w"}} | changes


def planted_cut(root: Path) -> Path:
    """``root/ps_00000003`` holding one server's whole file (server 0 of 1, lineage 0a)."""
    directory = root / "ps_00000003"
    directory.mkdir(parents=True)
    torch.save(server_file(), directory / "server_0_of_1.0a.pt")
    return directory


def within_bound(call: Callable[[], object], fifo: Path) -> object:
    """``call()``'s result; a call still blocked on ``fifo`` after BOUND_S is released (a writer opens it) and
    failed."""
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(_outcome(call)), daemon=True)
    thread.start()
    thread.join(BOUND_S)
    if thread.is_alive():
        with open(fifo, "wb"):  # lets the blocked open through
            pass
        thread.join(BOUND_S)
        pytest.fail(f"blocked on the named pipe {fifo} for {BOUND_S}s")
    return outcome[0]


def _outcome(call: Callable[[], object]) -> object:
    try:
        return call()
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return error


def test_raylastic_export_writes_a_planted_cut_with_its_tied_name(tmp_path, capsys):
    directory = planted_cut(tmp_path)
    assert cli_main(["export", str(directory), str(tmp_path / "model.pt")]) == 0, capsys.readouterr().err
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert exported.keys() == {"w", "head.w"} and torch.equal(exported["head.w"], torch.arange(4.0))


def _fifo(file: Path) -> str:
    os.mkfifo(file)
    return "is a named pipe (FIFO), not a regular file"


def _link_out(file: Path) -> str:
    outside = file.parent.parent / "elsewhere.pt"
    torch.save(server_file(), outside)
    file.symlink_to(outside)
    return "is a symbolic link out of the checkpoint directory"


def _directory(file: Path) -> str:
    file.mkdir()
    return "is a directory, not a regular file"


def _truncated(file: Path) -> str:
    file.write_bytes(b"PK\x03\x04 a torch.save cut short")
    return "could not be read"


def _saved(contents: object, problem: str) -> Callable[[Path], str]:
    def plant(file: Path) -> str:
        torch.save(contents, file)
        return problem
    return plant


BAD_FILES = {
    "fifo": _fifo,
    "link out": _link_out,
    "directory": _directory,
    "not a dict": _saved([torch.zeros(2)], "is not a parameter server's checkpoint: it holds a list, not a dict"),
    "no params": _saved({k: v for k, v in server_file().items() if k != "params"}, "it has no 'params'"),
    "params not tensors": _saved(server_file(params={"w": 3}), "its 'params' entry 'w' is not a tensor"),
    "tie to nothing": _saved(server_file(tied={"head.w": "gone"}), "ties 'head.w' to 'gone', which no file of"),
    "truncated": _truncated,
}


@pytest.mark.parametrize("plant", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_raylastic_export_of_a_bad_server_file_fails_naming_it(tmp_path, capsys, plant):
    directory = planted_cut(tmp_path)
    file = directory / "server_0_of_1.0a.pt"
    file.unlink()
    problem = plant(file)
    code = within_bound(lambda: cli_main(["export", str(directory), str(tmp_path / "model.pt")]), file)
    error = capsys.readouterr().err.replace("\n", "")
    assert code == 1, error
    assert f"{file}" in error and problem in error
    assert not (tmp_path / "model.pt").exists()


def test_a_restore_refuses_a_named_pipe_or_a_file_that_is_not_a_servers_at_once(tmp_path):
    saved_server(tmp_path)
    cut = newest_complete(str(tmp_path))
    file = Path(cut.files()[0])
    fresh = ParameterServer(server_spec(tmp_path), index=0, names=digits_names())
    file.unlink()
    os.mkfifo(file)
    refused = within_bound(lambda: fresh.restore(2, cut, "0b"), file)
    assert isinstance(refused, UnreadableCheckpoint) and "is a named pipe (FIFO)" in str(refused), refused
    file.unlink()
    torch.save(["not", "a", "dict"], file)
    with pytest.raises(UnreadableCheckpoint, match=r"server_0_of_1\.0a\.pt is not a parameter server's checkpoint"):
        fresh.restore(3, cut, "0c")
    torch.save(server_file(config_hash="h", version=2, params={"0.weight": torch.zeros(1)}), file)
    with pytest.raises(UnreadableCheckpoint, match=r"ps_00000002 does not hold '0.weight' as this model has it"):
        fresh.restore(4, cut, "0d")



@pytest.mark.usefixtures("ray_local")
def test_a_run_whose_newest_cut_holds_a_named_pipe_rejects_it_and_goes_on_without_it(tmp_path):
    """A FIFO planted as the newest cut's file made every restore wait on it until scaling.placement_timeout_s, and
    the same cut was tried again until failure.max_failures: now it is a checkpoint_rejected event naming it, and
    the run takes the cut before (here none: it starts afresh) and finishes."""
    from raylastic.cluster.job import train
    from tests.support.helpers import job

    root = tmp_path / "checkpoints"
    (root / "ps_00000020").mkdir(parents=True)
    fifo = root / "ps_00000020" / "server_0_of_1.ffffffffffffffff.pt"
    os.mkfifo(fifo)
    config = job("training.steps=10", "strategy.name=async_ps", "strategy.server_cpus=0.5", f"checkpoint.path={root}",
                 "scaling.placement_timeout_s=60", "failure.max_failures=1", name="ps-fifo")
    result = within_bound(lambda: train(config, run_dir=tmp_path / "run"), fifo)
    assert not isinstance(result, Exception), result
    [rejected] = [e for e in result.events if e.type == "checkpoint_rejected"]
    assert rejected.details["path"] == str(root / "ps_00000020")
    assert "server_0_of_1.ffffffffffffffff.pt is a named pipe (FIFO)" in rejected.details["reason"]
    assert [e.details["state_source"] for e in result.events if e.type == "generation_formed"] == ["start"]
    assert result.final_step == 10
