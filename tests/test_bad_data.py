"""Data that is not what it says, refused clearly: token files against their dtype and vocabulary, a
``raylastic tokenize`` interrupted or pointed at a directory that holds files, and a run whose training set
is empty (a real local Ray run).

    python -m pytest tests/test_bad_data.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import raylastic.workloads.token_checks as token_checks
import raylastic.workloads.tokens as tokens
from raylastic.cluster.cli import main as cli_main
from raylastic.workloads.gpt import TokenGPT
from raylastic.workloads.tokens import TokenBlocks, TokenFileError, encode_bytes, prepare_corpus, write_tokens

TEXT = "def f(x):\n    return x + 1  # naïve\n" * 40
SMALL_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16}


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    (tmp_path / "a.txt").write_text(TEXT, encoding="utf-8")
    return tmp_path / "a.txt"


def contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# -- token files against their dtype and vocabulary -----------------------------------------------------------


def test_uint32_ids_read_as_uint16_are_refused(tmp_path):
    write_tokens(tmp_path / "t.bin", encode_bytes(TEXT), "uint32")  # a whole number of uint16s too
    with pytest.raises(TokenFileError, match=r"read as uint16, every second value of the \d+ tokens checked is 0: "
                                             "the file holds uint32 token ids"):
        TokenBlocks(tmp_path / "t.bin", block_size=16, dtype="uint16", vocab_size=256)
    assert len(TokenBlocks(tmp_path / "t.bin", block_size=16, dtype="uint32", vocab_size=256)) > 0


def test_uint16_ids_read_as_uint32_are_out_of_the_vocabulary(tmp_path):
    write_tokens(tmp_path / "t.bin", encode_bytes(TEXT)[:1000], "uint16")  # a whole number of uint32s too
    with pytest.raises(TokenFileError, match=r"token 0 is \d+, not below the vocabulary size 256 "
                                             r"\(uint16 ids read as uint32\?\)"):
        TokenBlocks(tmp_path / "t.bin", block_size=16, dtype="uint32", vocab_size=256)


def test_an_id_out_of_the_vocabulary_is_refused_at_the_start_naming_its_position(tmp_path):
    ids = np.arange(5000) % 256
    ids[1234] = 300
    write_tokens(tmp_path / "t.bin", ids, "uint16")
    with pytest.raises(TokenFileError, match=r"t.bin: token 1234 is 300, not below the vocabulary size 256; the "
                                             r"file, read as uint16, must hold ids 0..255"):
        TokenBlocks(tmp_path / "t.bin", block_size=16, vocab_size=256)
    assert len(TokenBlocks(tmp_path / "t.bin", block_size=16)) > 0  # no vocabulary given: nothing to check


def test_an_id_out_of_the_vocabulary_beyond_the_pieces_checked_at_the_start_is_refused_when_fetched(tmp_path,
                                                                                                   monkeypatch):
    monkeypatch.setattr(token_checks, "CHECK_PIECES", 2)  # pieces at the start and the end of the file only
    monkeypatch.setattr(token_checks, "CHECK_PIECE_TOKENS", 64)
    ids = np.arange(5000) % 256
    ids[2000] = 999
    write_tokens(tmp_path / "t.bin", ids, "uint16")
    blocks = TokenBlocks(tmp_path / "t.bin", block_size=16, vocab_size=256)
    blocks.__getitems__([0, 1, 123, 126])  # windows around it are fine
    with pytest.raises(TokenFileError, match="token 2000 is 999, not below the vocabulary size 256"):
        blocks.__getitems__([3, 125])  # window 125 holds tokens 2000..2016
    with pytest.raises(TokenFileError, match="token 2000 is 999"):
        blocks.__getitems__([124])  # its last target is token 2000


def test_the_gpt_workload_names_the_data_directory_and_meta_json(tmp_path, text_file):
    data = tmp_path / "tokens"
    prepare_corpus([text_file], data, val_fraction=0.25)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "vocab_size": 100}))  # the bytes go up to 0xc3 here
    with pytest.raises(ValueError, match=rf"workload.options.data_dir='{data}' holds a train.bin that does not "
                                         r"match its meta.json \(dtype uint16, vocab_size 100\): .*not below the "
                                         "vocabulary size 100"):
        TokenGPT(data_dir=str(data), **SMALL_GPT)

    (data / "meta.json").write_text(json.dumps({**meta, "vocab_size": 70_000}))
    with pytest.raises(ValueError, match="meta.json's vocab_size 70000 does not fit its dtype uint16"):
        TokenGPT(data_dir=str(data), **SMALL_GPT)


# -- raylastic tokenize: a new directory renamed into place ---------------------------------------------------


def test_an_interrupted_tokenize_leaves_the_old_directory_as_it_was(tmp_path, text_file, monkeypatch):
    out = tmp_path / "tokens"
    prepare_corpus([text_file], out, val_fraction=0.25)
    before = contents(out)
    (tmp_path / "b.txt").write_text("another corpus\n" * 100)
    moved = tokens._move_tail

    def interrupted_after_val_bin(*args, **kwargs):
        moved(*args, **kwargs)
        raise KeyboardInterrupt  # Ctrl-C once val.bin is written, before train.bin and meta.json

    monkeypatch.setattr(tokens, "_move_tail", interrupted_after_val_bin)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus([tmp_path / "b.txt"], out, val_fraction=0.5, overwrite=True)
    assert contents(out) == before  # not a new val.bin beside the old train.bin and meta.json
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "tokens"]  # nothing left beside it

    monkeypatch.setattr(tokens, "_move_tail", moved)
    meta = prepare_corpus([tmp_path / "b.txt"], out, val_fraction=0.5, overwrite=True)
    assert json.loads((out / "meta.json").read_text()) == meta and meta["val_tokens"] == len("another corpus\n" * 50)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "tokens"]


def test_tokenize_refuses_an_existing_directory_without_force(tmp_path, text_file, capsys):
    out = tmp_path / "tokens"
    assert cli_main(["tokenize", str(out), str(text_file)]) == 0
    before = contents(out)
    assert cli_main(["tokenize", str(out), str(text_file), "--val-fraction", "0.5"]) == 2
    err = capsys.readouterr().err
    assert f"{out} exists and holds meta.json, train.bin, val.bin" in err and "--force" in err
    assert contents(out) == before
    assert cli_main(["tokenize", str(out), str(text_file), "--val-fraction", "0.5", "--force"]) == 0
    assert json.loads((out / "meta.json").read_text())["val_tokens"] == len(TEXT.encode()) // 2


def test_tokenize_never_replaces_a_directory_holding_other_files(tmp_path, text_file, capsys):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.md").write_text("the user's")
    (out / "train.bin").write_bytes(b"old")
    assert cli_main(["tokenize", str(out), str(text_file), "--force"]) == 2
    assert f"{out} holds todo.md, which a token directory does not" in capsys.readouterr().err
    assert contents(out) == {"todo.md": b"the user's", "train.bin": b"old"}

    empty = tmp_path / "empty"
    empty.mkdir()  # nothing in it to lose: written without --force
    assert cli_main(["tokenize", str(empty), str(text_file)]) == 0
    assert sorted(contents(empty)) == ["meta.json", "train.bin", "val.bin"]


# -- a training set that is empty, in a real run --------------------------------------------------------------


@pytest.mark.usefixtures("ray_local")
def test_a_run_on_an_empty_training_set_fails_at_the_start_naming_the_sizes(tmp_path):
    from raylastic.actors.status.run import RunFailed
    from raylastic.cluster.job import train
    from tests.support.helpers import job

    config = job("workload.name=tests.support.user_workload:Parity", "workload.options={num_samples: 0}",
                 "scaling.min_workers=2", "scaling.max_workers=2", name="empty-data")
    with pytest.raises(RunFailed) as raised:
        train(config, run_dir=tmp_path / "run")
    message = str(raised.value)
    assert "train_dataset() has 0 samples: nothing to train on (training.global_batch_size=48" in message, message
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "failed" and result["history"] == []  # not a single step was tried
