"""The files a run and ``raylastic export`` leave are replaced whole and durably (strategies/atomic_file.py): a write
that fails leaves the file that was there and no temporary one, model.pt and result.json are fsync'd with their
directory; the model bytes a worker sends are read back as tensors only; result.json's config shows no credentials of
``tracking.mlflow_uri``. Real files, the real ``os.fsync`` (watched)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch

from raylastic.actors.status.run import RunFailed
from raylastic.cluster.run_dir import SeenProgress, read_model_file, write_model, write_result
from raylastic.strategies.atomic_file import write_atomically
from raylastic.strategies.export import export_model
from tests.support.helpers import job


class RunsCode:
    """What a pickle may do besides tensors: call a function (here a harmless one) as it is loaded."""

    def __reduce__(self):
        return os.getpid, ()


def test_a_write_that_fails_leaves_the_file_there_and_no_temporary(tmp_path):
    target = tmp_path / "result.json"
    target.write_text("the old one")

    def half_then_full_disk(handle) -> None:
        handle.write(b"{\"half\": ")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomically(target, half_then_full_disk)
    assert target.read_text() == "the old one" and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]
    write_atomically(target, lambda handle: handle.write(b"the new one"))
    assert target.read_text() == "the new one" and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_raylastic_export_that_fails_leaves_no_torn_model_file(tmp_path):
    """It wrote its output in place: a save that failed halfway (a full disk; here a value torch cannot save) left a
    torn .pt where the last export was."""
    output = tmp_path / "model.pt"
    export_model({"w": torch.ones(3)}, output)
    with pytest.raises(Exception, match="lambda"):
        export_model({"w": torch.zeros(3), "later": lambda: None}, output)
    assert torch.equal(torch.load(output, weights_only=True)["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_model_pt_and_result_json_are_fsynced_then_their_directory(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def watched(descriptor: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", watched)
    write_model(tmp_path, {"w": torch.ones(2)})
    write_result(tmp_path, job(name="synced"), status="failed", error="boom", progress=SeenProgress())
    names = [Path(path).name for path in synced]
    assert len(names) == 4 and names[0].startswith("model.pt.") and names[2].startswith("result.json."), names
    assert synced[1] == synced[3] == str(tmp_path)
    assert json.loads((tmp_path / "result.json").read_text())["error"] == "boom"
    assert torch.equal(torch.load(tmp_path / "model.pt", weights_only=True)["w"], torch.ones(2))


def test_the_model_bytes_are_read_as_tensors_only(tmp_path):
    plain = io.BytesIO()
    torch.save({"w": torch.ones(2)}, plain)
    assert torch.equal(read_model_file(plain.getvalue())["w"], torch.ones(2))
    with_code = io.BytesIO()
    torch.save({"w": torch.ones(2), "x": RunsCode()}, with_code)
    with pytest.raises(RunFailed, match="the final model is not a plain state dict"):
        read_model_file(with_code.getvalue())


@pytest.mark.parametrize(("uri", "shown"), [
    ("https://alice:s3cret@mlflow.example.com:5000/api?token=abc&x", "https://***@mlflow.example.com:5000/api?token=***&x"),
    ("https://tok3n@mlflow.example.com", "https://***@mlflow.example.com"),
    ("sqlite:////srv/mlruns/mlflow.db", "sqlite:////srv/mlruns/mlflow.db"),
    ("/home/a@b/mlruns", "/home/a@b/mlruns"),
])
def test_result_json_shows_the_mlflow_uri_without_its_credentials(tmp_path, uri, shown):
    write_result(tmp_path, job(f"tracking.mlflow_uri={uri}", name="secret"), status="failed", error="boom",
                 progress=SeenProgress())
    written = (tmp_path / "result.json").read_text()
    assert json.loads(written)["config"]["tracking"]["mlflow_uri"] == shown
    assert "s3cret" not in written and "tok3n" not in written and "token=abc" not in written
