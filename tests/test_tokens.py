"""Token files, TokenBlocks, ``raylastic tokenize`` and the gpt workload; single process, no Ray.

    python -m pytest tests/test_tokens.py -q
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from raylastic.cluster.cli import main as cli_main
from raylastic.workloads import load_workload
from raylastic.workloads.gpt import TokenGPT
from raylastic.workloads.tokens import (
    TokenBlocks,
    decode_bytes,
    encode_bytes,
    prepare_corpus,
    stacked,
    stdlib_corpus_files,
    write_tokens,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["def f(x):\n    return x + 1  # naïve\n" * 40, "Größe → 大きさ, ünïcödé\n" * 30, "plain ascii tail\n" * 25]
SMALL_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16}

# Iterates a DataLoader over every window of the token file argv[1] and prints the growth of the peak
# resident set (VmHWM) while iterating; argv[2] == "long_lived" holds one np.memmap instead (the control).
RSS_PROBE = """
import sys
import numpy as np
import torch
from torch.utils.data import DataLoader
from raylastic.workloads.tokens import TokenBlocks, stacked

def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

class LongLived(TokenBlocks):  # the mistake TokenBlocks avoids: one map kept for the dataset's life
    def __getitems__(self, indices):
        if not hasattr(self, "tokens"):
            self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        windows = self.tokens[np.asarray(indices)[:, None] * self.block_size + np.arange(self.block_size + 1)]
        windows = torch.from_numpy(windows.astype(np.int64))
        return windows[:, :-1], windows[:, 1:]

class Batches:
    def __init__(self, n, size): self.n, self.size = n, size
    def __len__(self): return -(-self.n // self.size)
    def __iter__(self): return (list(range(s, min(s + self.size, self.n))) for s in range(0, self.n, self.size))

blocks = (LongLived if sys.argv[2] == "long_lived" else TokenBlocks)(sys.argv[1], block_size=512)
loader = DataLoader(blocks, batch_sampler=Batches(len(blocks), 64), collate_fn=stacked, num_workers=0)
next(iter(loader))  # first-use allocations are not what is measured
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
except OSError:
    pass
before = peak_rss()
seen = sum(len(inputs) for inputs, targets in loader)
assert seen == len(blocks), (seen, len(blocks))
print(peak_rss() - before)
"""


@pytest.fixture
def text_files(tmp_path: Path) -> list[Path]:
    files = []
    for position, text in enumerate(TEXTS):
        files.append(tmp_path / "texts" / f"{position}.txt")
        files[-1].parent.mkdir(exist_ok=True)
        files[-1].write_text(text, encoding="utf-8")
    return files


@pytest.fixture
def token_dir(tmp_path: Path, text_files: list[Path]) -> Path:
    prepare_corpus(text_files, tmp_path / "tokens", val_fraction=0.25)
    return tmp_path / "tokens"


def test_prepare_corpus_round_trip_split_and_meta(tmp_path, text_files):
    meta = prepare_corpus(text_files, tmp_path / "out", val_fraction=0.1)
    train = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint16)
    expected = "\n".join(TEXTS)
    assert decode_bytes(np.concatenate([train, val])) == expected
    total = len(expected.encode("utf-8"))
    assert (len(train), len(val)) == (total - int(total * 0.1), int(total * 0.1))
    assert meta == {"vocab_size": 256, "dtype": "uint16", "tokenizer": "bytes",
                    "train_tokens": len(train), "val_tokens": len(val)}
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == meta
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_prepare_corpus_streams_files_in_pieces(tmp_path, monkeypatch):
    import raylastic.workloads.tokens as tokens

    monkeypatch.setattr(tokens, "READ_CHUNK_BYTES", 7)  # multi-byte characters straddle the pieces
    monkeypatch.setattr(tokens, "COPY_CHUNK_TOKENS", 5)
    (tmp_path / "a.txt").write_text(TEXTS[1], encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(b"latin-1 \xe9t\xe9\n")  # not UTF-8: replaced, not fatal
    meta = prepare_corpus([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "out", dtype="uint32")
    tokens_read = np.concatenate([np.fromfile(tmp_path / "out" / name, dtype=np.uint32)
                                  for name in ("train.bin", "val.bin")])
    assert decode_bytes(tokens_read) == TEXTS[1] + "\nlatin-1 \ufffdt\ufffd\n"
    assert meta["dtype"] == "uint32" and meta["train_tokens"] + meta["val_tokens"] == len(tokens_read)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"val_fraction": 1.0}, "val_fraction"),
    ({"dtype": "int8"}, "dtype must be one of uint16, uint32"),
])
def test_prepare_corpus_rejects_bad_arguments(tmp_path, text_files, kwargs, message):
    with pytest.raises(ValueError, match=message):
        prepare_corpus(text_files, tmp_path / "out", **kwargs)


def test_encode_and_write_tokens(tmp_path):
    assert encode_bytes("hé").tolist() == [104, 195, 169] and encode_bytes("").dtype == np.uint16
    assert write_tokens(tmp_path / "t.bin", [1, 2, 70_000], "uint32") == 3
    assert write_tokens(tmp_path / "t.bin", [4], "uint32", append=True) == 1
    assert np.fromfile(tmp_path / "t.bin", dtype=np.uint32).tolist() == [1, 2, 70_000, 4]
    with pytest.raises(ValueError, match="must lie in"):
        write_tokens(tmp_path / "u.bin", [70_000], "uint16")


@pytest.mark.parametrize(("dtype", "high"), [("uint16", 2**16), ("uint32", 2**32)])
def test_token_blocks_match_a_direct_read(tmp_path, dtype, high):
    ids = np.random.default_rng(0).integers(0, high, size=1000, dtype=np.int64)
    write_tokens(tmp_path / "t.bin", ids, dtype)
    blocks = TokenBlocks(tmp_path / "t.bin", block_size=32, dtype=dtype)
    assert len(blocks) == (1000 - 1) // 32
    raw = np.fromfile(tmp_path / "t.bin", dtype=dtype).astype(np.int64)
    for i in (0, 5, len(blocks) - 1):
        inputs, targets = blocks[i]
        assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == (32,)
        assert inputs.tolist() == raw[i * 32:(i + 1) * 32].tolist()
        assert targets.tolist() == raw[i * 32 + 1:(i + 1) * 32 + 1].tolist()
    batch_inputs, batch_targets = blocks.__getitems__([7, 0, 7, -1])
    assert batch_inputs.shape == batch_targets.shape == (4, 32)
    assert torch.equal(batch_inputs[1:, 1:], batch_targets[1:, :-1])  # targets are inputs shifted by one
    for row, i in enumerate([7, 0, 7, len(blocks) - 1]):
        assert torch.equal(batch_inputs[row], blocks[i][0]) and torch.equal(batch_targets[row], blocks[i][1])
    with pytest.raises(IndexError):
        blocks.__getitems__([len(blocks)])


def test_token_blocks_pickle_cheaply_and_feed_a_data_loader(tmp_path):
    write_tokens(tmp_path / "t.bin", np.arange(4000) % 256, "uint16")
    blocks = TokenBlocks(tmp_path / "t.bin", block_size=16)
    assert len(pickle.dumps(blocks)) < 1000
    loader = DataLoader(blocks, batch_size=8, shuffle=False, collate_fn=stacked)
    inputs, targets = next(iter(loader))
    assert torch.equal(inputs, blocks.__getitems__(list(range(8)))[0]) and targets.shape == (8, 16)
    assert all(torch.equal(a, b) for a, b in zip(stacked([blocks[0], blocks[1]]), blocks.__getitems__([0, 1]),
                                                 strict=True))
    with pytest.raises(ValueError, match="block_size"):
        TokenBlocks(tmp_path / "t.bin", block_size=4000)
    write_tokens(tmp_path / "odd.bin", [1, 2, 3], "uint16")
    with pytest.raises(ValueError, match="whole number of uint32"):
        TokenBlocks(tmp_path / "odd.bin", block_size=1, dtype="uint32")


def _write_token_file(path: Path, megabytes: int) -> None:
    chunk = (np.arange(1 << 20) % 256).astype(np.uint16)  # 2 MB
    with open(path, "wb") as f:
        for _ in range(megabytes // 2):
            chunk.tofile(f)


def _peak_rss_growth(path: Path, mode: str = "fresh_maps") -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", RSS_PROBE, str(path), mode], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120, check=True)
    return int(result.stdout.split()[-1])


@pytest.mark.processes
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_resident_memory_does_not_grow_with_the_file(tmp_path):
    small, large = tmp_path / "small.bin", tmp_path / "large.bin"
    _write_token_file(small, 32)
    _write_token_file(large, 256)
    try:
        small_growth, large_growth = _peak_rss_growth(small), _peak_rss_growth(large)
        long_lived_growth = _peak_rss_growth(large, "long_lived")
    finally:
        small.unlink()
        large.unlink()
    mb = 1 << 20
    print(f"peak RSS growth: 32 MB file {small_growth / mb:.1f} MB, 256 MB file {large_growth / mb:.1f} MB, "
          f"256 MB file with one long-lived memmap {long_lived_growth / mb:.1f} MB")
    assert large_growth < small_growth + 16 * mb
    assert large_growth < 64 * mb
    assert long_lived_growth > 128 * mb  # the measurement does see a map whose pages stay resident


def test_tokenize_command_writes_a_token_directory(tmp_path, text_files, capsys):
    out = tmp_path / "out"
    assert cli_main(["tokenize", str(out), str(text_files[0].parent), "--val-fraction", "0.2"]) == 0
    assert {p.name for p in out.iterdir()} == {"train.bin", "val.bin", "meta.json"}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train_tokens"] + meta["val_tokens"] == len("\n".join(TEXTS).encode("utf-8"))
    assert "workload.name=gpt" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    ([], "no input files"),
    (["missing.txt"], "no such file or directory"),
    (["texts", "--val-fraction", "1.5"], "--val-fraction must be in (0, 1)"),
    (["texts", "--glob", "*.rst"], "no files matching *.rst"),
])
def test_tokenize_command_errors_exit_2(tmp_path, text_files, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["tokenize", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


def test_tokenize_command_rejects_a_bad_dtype(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["tokenize", str(tmp_path), "--stdlib", "--dtype", "int8"])
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err


def test_stdlib_corpus_files_are_sorted_py_files_without_tests():
    files = stdlib_corpus_files()
    assert len(files) > 100 and files == sorted(files) and all(f.suffix == ".py" for f in files)
    assert not any({"test", "tests", "site-packages"} & set(f.parts) for f in files)
    assert any(f.name == "os.py" for f in files) and any(f.parent.name == "json" for f in files)


def test_token_gpt_initial_loss_and_registry(token_dir):
    workload = load_workload("gpt", {"data_dir": str(token_dir), **SMALL_GPT})
    assert isinstance(workload, TokenGPT)
    torch.manual_seed(0)
    model = workload.build_model()
    batch = workload.collate(workload.train_dataset().__getitems__([0, 1, 2, 3]))
    loss = workload.training_step(model, batch)
    assert loss.dim() == 0 and abs(loss.item() - math.log(256)) < 0.5
    loss.backward()


def test_token_gpt_dropout_acts_in_train_mode_only(token_dir):
    torch.manual_seed(0)
    workload = TokenGPT(data_dir=str(token_dir), dropout=0.5, **SMALL_GPT)
    model = workload.build_model()
    inputs, _ = workload.train_dataset().__getitems__([0, 1])
    assert not torch.equal(model(inputs), model(inputs))
    model.eval()
    assert torch.equal(model(inputs), model(inputs))


def test_token_gpt_optimizer_groups_cover_every_parameter_once(token_dir):
    workload = TokenGPT(data_dir=str(token_dir), weight_decay=0.2, **SMALL_GPT)
    model = workload.build_model()
    decay, no_decay = workload.configure_optimizer(model).param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.2, 0.0)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    grouped = [id(p) for p in decay["params"] + no_decay["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters()) and len(set(grouped)) == len(grouped)
    assert any(p is model.wte.weight for p in decay["params"])  # the tied embedding / lm head decays


def test_token_gpt_eval_step_returns_sums(token_dir):
    workload = TokenGPT(data_dir=str(token_dir), eval_blocks=5, **SMALL_GPT)
    torch.manual_seed(0)
    model = workload.build_model().eval()
    dataset = workload.eval_dataset()
    assert len(dataset) == 5
    batch = workload.collate(dataset.__getitems__(list(range(5))))  # Subset hands the list to TokenBlocks
    metrics = workload.eval_step(model, batch)
    assert metrics["eval_loss"].item() == pytest.approx(5 * workload.training_step(model, batch).item(), rel=1e-5)
    assert abs(metrics["eval_loss"].item() / 5 - math.log(256)) < 0.5
    assert metrics["bits_per_byte"].item() == pytest.approx(metrics["eval_loss"].item() / math.log(2))


@pytest.mark.parametrize(("options", "message"), [
    ({"data_dir": None}, "workload.options.data_dir is required.*raylastic tokenize DIR --stdlib"),
    ({"data_dir": "/nonexistent/tokens"}, "workload.options.data_dir=.*raylastic tokenize DIR --stdlib"),
    ({"n_layer": 0}, "workload.options.n_layer must be a positive int"),
    ({"n_embd": 30, "n_head": 4}, "workload.options.n_embd must be divisible by n_head=4"),
    ({"dropout": 1.0}, r"workload.options.dropout must be a float in \[0, 1\)"),
    ({"weight_decay": -0.1}, "workload.options.weight_decay must be a float >= 0"),
    ({"eval_blocks": 0}, "workload.options.eval_blocks must be a positive int"),
    ({"block_size": 100_000}, "workload.options.block_size=100000 does not fit"),
])
def test_token_gpt_bad_options_name_the_option(token_dir, options, message):
    with pytest.raises(ValueError, match=message):
        TokenGPT(**{"data_dir": str(token_dir), **SMALL_GPT, **options})


def test_token_gpt_needs_meta_json(token_dir):
    (token_dir / "meta.json").unlink()
    with pytest.raises(ValueError, match="has no meta.json.*raylastic tokenize"):
        TokenGPT(data_dir=str(token_dir), **SMALL_GPT)
