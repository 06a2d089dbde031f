"""Token files in nanoGPT's ``.bin`` layout, a byte-level tokenizer and a memory-safe dataset over them.

A ``.bin`` file is a flat array of token ids (``uint16`` or ``uint32``, native byte order, no header),
as nanoGPT's ``prepare.py`` scripts write (https://github.com/karpathy/nanoGPT). Make one from the
Python standard library's source (every install has it, ~12 MB) and read it back::

    raylastic tokenize data/stdlib --stdlib
    python -c "from raylastic.workloads.tokens import TokenBlocks; print(len(TokenBlocks('data/stdlib/train.bin', 64)))"

``TokenBlocks`` opens a fresh ``numpy.memmap`` for every fetch and drops it after copying the windows
out, as nanoGPT's ``get_batch`` does: pages of a long-lived map stay in the process's resident set once
touched, so one epoch over a large file would grow every DataLoader worker by the file's size.

Given a vocabulary size, ``TokenBlocks`` checks its file against it and its dtype when it is made
(workloads/token_checks.py) and checks every window it fetches, so no id at or above the vocabulary size
ever reaches a model (on CUDA, an embedding would fail with a device-side assert).
"""

from __future__ import annotations

import codecs
import json
import os
import secrets
import shutil
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch.utils.data import Dataset

from raylastic.workloads.token_checks import TokenFileError, check_token_file, numpy_dtype, out_of_vocabulary

VOCAB_SIZE = 256  # the byte-level tokenizer: one token per byte
READ_CHUNK_BYTES = 8 << 20  # prepare_corpus reads, decodes and writes files in pieces of this size
COPY_CHUNK_TOKENS = 8 << 20
PROGRESS_MIN_BYTES = 32 << 20  # a progress bar for corpora from this size or this many files
PROGRESS_MIN_FILES = 200  # (on a terminal's stderr only)
TOKEN_DIR_FILES = ("train.bin", "val.bin", "meta.json")


def encode_bytes(text: str) -> np.ndarray:
    """``text``'s UTF-8 bytes as ``uint16`` token ids (vocabulary 256).

    Example::

        encode_bytes("hé").tolist() == [104, 195, 169]
    """
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def decode_bytes(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
    """The text of byte-level ``token_ids`` (invalid UTF-8, e.g. a window cut mid-character, becomes U+FFFD).

    Example::

        decode_bytes(TokenBlocks("data/stdlib/val.bin", 256)[0][0])  # the first 256 bytes of val.bin
    """
    return bytes(np.asarray(token_ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def write_tokens(path: str | os.PathLike, token_ids: Sequence[int] | np.ndarray, dtype: str = "uint16", *,
                 append: bool = False) -> int:
    """Write (or with ``append``, add) ``token_ids`` to ``path`` as a headerless ``dtype`` array; returns their count.

    Raises ValueError when ``dtype`` is not uint16/uint32 or an id does not fit it.

    Example::

        write_tokens("tiny.bin", encode_bytes("hello"), "uint16")  # 10 bytes on disk
    """
    array = _as_dtype(token_ids, dtype)
    with open(path, "ab" if append else "wb") as f:
        array.tofile(f)
    return int(array.size)


def stdlib_corpus_files() -> list[Path]:
    """Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``, recursively, sorted, without
    ``site-packages`` and ``test``/``tests`` directories: an offline text corpus every Python has.

    Example::

        len(stdlib_corpus_files())  # 799 files, 12.6 MB on CPython 3.11
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    excluded = {"site-packages", "test", "tests"}
    return sorted(path for path in stdlib.rglob("*.py")
                  if path.is_file() and not excluded & set(path.relative_to(stdlib).parts[:-1]))


def prepare_corpus(files: Sequence[str | os.PathLike], out_dir: str | os.PathLike, val_fraction: float = 0.1,
                   dtype: str = "uint16", *, overwrite: bool = False) -> dict:
    """Tokenize ``files`` (joined in order by a newline) into ``out_dir``'s train.bin, val.bin and meta.json.

    The files are read as UTF-8 (undecodable bytes become U+FFFD) and streamed in 8 MB pieces, so a
    corpus larger than memory works; val.bin holds the trailing ``val_fraction`` of the tokens. Returns
    what meta.json holds: ``vocab_size``, ``dtype``, ``tokenizer`` ("bytes"), ``train_tokens``, ``val_tokens``.

    The three files are written into a new directory beside ``out_dir`` that is renamed into place once they
    are complete, so an interruption leaves ``out_dir`` as it was. An existing, non-empty ``out_dir`` is
    refused (ValueError) unless ``overwrite``; even then, only one that holds nothing but those three files.

    Example::

        prepare_corpus(stdlib_corpus_files(), "data/stdlib")  # ~11 M train tokens, ~1.2 M val
    """
    if not (isinstance(val_fraction, (int, float)) and not isinstance(val_fraction, bool)
            and 0.0 < val_fraction < 1.0):
        raise ValueError(f"val_fraction must be a float in (0, 1), got {val_fraction!r}")
    numpy_dtype(dtype)
    paths = [Path(f) for f in files]
    if not paths:
        raise ValueError("files is empty: give at least one text file")
    out = Path(out_dir)
    out = out.resolve() if out.is_symlink() else out  # the directory it names is the one replaced
    _require_replaceable(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f"{out.name}.tokenizing-{secrets.token_hex(4)}")
    staging.mkdir()
    try:
        meta = _write_token_dir(paths, staging, val_fraction, dtype)
        _move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already once it is in place
    return meta


def _require_replaceable(out: Path, overwrite: bool) -> None:
    """Refuse to write over anything in ``out`` unless ``overwrite``, and over anything but a token directory."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory: give another output directory")
    names = sorted(entry.name for entry in out.iterdir())
    if names and not overwrite:
        raise ValueError(f"{out} exists and holds {', '.join(names)}: give another output directory, or replace "
                         "it with --force (overwrite=True)")
    others = [name for name in names if name not in TOKEN_DIR_FILES]
    if others:
        raise ValueError(f"{out} holds {', '.join(others)}, which a token directory does not: it is not replaced, "
                         f"even with --force (only one holding nothing but {', '.join(TOKEN_DIR_FILES)} is)")


def _move_into_place(staging: Path, out: Path) -> None:
    """Rename the complete ``staging`` directory to ``out``; an old ``out`` is moved aside first, then deleted."""
    if out.is_dir() and any(out.iterdir()):
        aside = out.with_name(f"{out.name}.replaced-{secrets.token_hex(4)}")
        out.rename(aside)
        staging.rename(out)
        shutil.rmtree(aside)
    else:
        staging.replace(out)  # onto a missing or empty directory


def _write_token_dir(paths: list[Path], out: Path, val_fraction: float, dtype: str) -> dict:
    """train.bin, val.bin and meta.json of ``paths`` in the (new, empty) directory ``out``; returns the meta."""
    train_path, val_path = out / "train.bin", out / "val.bin"
    partial = out / "tokens.bin.partial"
    total = _write_concatenated(paths, partial, dtype)
    val_tokens = int(total * val_fraction)
    if val_tokens < 1 or total - val_tokens < 1:
        raise ValueError(f"the files hold {total} tokens: too few to split with val_fraction={val_fraction}")
    _move_tail(partial, val_path, total - val_tokens, dtype)
    partial.replace(train_path)
    meta = {"vocab_size": VOCAB_SIZE, "dtype": dtype, "tokenizer": "bytes",
            "train_tokens": total - val_tokens, "val_tokens": val_tokens}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _write_concatenated(paths: list[Path], out_path: Path, dtype: str) -> int:
    """Append each file's UTF-8 bytes (a newline between files) to ``out_path`` as tokens; returns the count."""
    from rich.console import Console
    from rich.progress import Progress

    total_bytes = sum(path.stat().st_size for path in paths)  # also fails early on a missing file
    console = Console(stderr=True)
    show = console.is_terminal and (total_bytes >= PROGRESS_MIN_BYTES or len(paths) >= PROGRESS_MIN_FILES)
    written = 0
    with open(out_path, "wb") as out, Progress(console=console, transient=True, disable=not show) as progress:
        task = progress.add_task(f"tokenizing {len(paths)} files", total=total_bytes)
        for position, path in enumerate(paths):
            if position:
                written += _append(out, encode_bytes("\n"), dtype)
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span two pieces
            with open(path, "rb") as f:
                while piece := f.read(READ_CHUNK_BYTES):
                    written += _append(out, encode_bytes(decoder.decode(piece)), dtype)
                    progress.advance(task, len(piece))
            written += _append(out, encode_bytes(decoder.decode(b"", final=True)), dtype)
    return written


def _move_tail(path: Path, tail_path: Path, start: int, dtype: str) -> None:
    """Move tokens ``[start, end)`` of ``path`` into ``tail_path`` (copied in pieces), then truncate ``path``."""
    itemsize = np.dtype(numpy_dtype(dtype)).itemsize
    with open(path, "r+b") as src, open(tail_path, "wb") as dst:
        src.seek(start * itemsize)
        while piece := src.read(COPY_CHUNK_TOKENS * itemsize):
            dst.write(piece)
        src.truncate(start * itemsize)


class TokenBlocks(Dataset):
    """Non-overlapping ``block_size`` windows of a ``.bin`` token file, each with its next-token targets.

    Item ``i`` is ``(inputs, targets)``, int64 tensors of length ``block_size``: tokens
    ``[i * block_size, (i + 1) * block_size)`` and the same shifted by one, so there are
    ``(num_tokens - 1) // block_size`` items. ``__getitems__(indices)`` returns them already batched,
    ``(inputs[n, block_size], targets[n, block_size])``, which torch's DataLoader then hands to its
    collate function: pair it with ``collate_fn=stacked``. Each fetch maps the file afresh and unmaps it,
    so resident memory does not grow with the file; pickling carries only the path, dtype and sizes.

    With ``vocab_size``, a file that is not ``dtype`` ids below it raises TokenFileError when the blocks are made
    (on the pieces workloads/token_checks.py reads) or, for an id found later, when its window is fetched.

    Example::

        blocks = TokenBlocks("data/stdlib/train.bin", block_size=256, vocab_size=256)
        loader = DataLoader(blocks, batch_size=64, shuffle=True, collate_fn=stacked, num_workers=2)
        inputs, targets = next(iter(loader))  # int64[64, 256] each
    """

    def __init__(self, path: str | os.PathLike, block_size: int, dtype: str = "uint16",
                 vocab_size: int | None = None):
        if not (isinstance(block_size, int) and not isinstance(block_size, bool) and block_size > 0):
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        largest = int(np.iinfo(numpy_dtype(dtype)).max)
        if vocab_size is not None and not (isinstance(vocab_size, int) and not isinstance(vocab_size, bool)
                                           and 0 < vocab_size <= largest + 1):
            raise ValueError(f"vocab_size must be a positive int of at most {largest + 1} for dtype {dtype} "
                             f"(ids 0..{largest}), got {vocab_size!r}")
        self.path = os.fspath(path)
        self.block_size = block_size
        self.dtype = dtype
        self.vocab_size = vocab_size
        itemsize = np.dtype(numpy_dtype(dtype)).itemsize
        size = os.path.getsize(self.path)
        if size % itemsize:
            raise TokenFileError(f"{self.path}: {size} bytes is not a whole number of {dtype} tokens (wrong dtype?)")
        self.num_tokens = size // itemsize
        if len(self) == 0:
            raise ValueError(f"{self.path}: {self.num_tokens} tokens, fewer than block_size + 1 = {block_size + 1}")
        check_token_file(self.path, dtype, vocab_size)

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.__getitems__([index])
        return inputs[0], targets[0]

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows ``indices`` as ``(inputs, targets)``, int64 ``[len(indices), block_size]`` each."""
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < -len(self) or rows.max() >= len(self)):
            raise IndexError(f"index out of range for {len(self)} blocks: {rows.min()}..{rows.max()}")
        rows = np.where(rows < 0, rows + len(self), rows)
        tokens = np.memmap(self.path, dtype=numpy_dtype(self.dtype), mode="r")  # fresh map: see module docstring
        windows = tokens[rows[:, None] * self.block_size + np.arange(self.block_size + 1)].astype(np.int64)
        del tokens  # unmaps the file: its touched pages leave the resident set
        if self.vocab_size is not None and windows.size and windows.max() >= self.vocab_size:
            row, column = np.argwhere(windows >= self.vocab_size)[0]
            raise TokenFileError(out_of_vocabulary(self.path, self.dtype, self.vocab_size, int(windows[row, column]),
                                                    int(rows[row]) * self.block_size + int(column)))
        return (torch.from_numpy(np.ascontiguousarray(windows[:, :-1])),
                torch.from_numpy(np.ascontiguousarray(windows[:, 1:])))


def stacked(batch: tuple[torch.Tensor, torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]],
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate for ``TokenBlocks``: its ``__getitems__`` batch passes through; a list of items is stacked.

    Example::

        stacked(blocks.__getitems__([0, 1])) is the same tuple; stacked([blocks[0], blocks[1]]) equals it
    """
    if isinstance(batch, tuple) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
        return batch
    inputs, targets = zip(*batch, strict=True)
    return torch.stack(inputs), torch.stack(targets)


def _append(out: BinaryIO, token_ids: np.ndarray, dtype: str) -> int:
    array = _as_dtype(token_ids, dtype)
    array.tofile(out)
    return int(array.size)


def _as_dtype(token_ids: Sequence[int] | np.ndarray, dtype: str) -> np.ndarray:
    ids = np.asarray(token_ids)
    array = ids.astype(numpy_dtype(dtype), copy=False)
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(array.dtype).max):
        raise ValueError(f"dtype={dtype!r}: token ids must lie in [0, {np.iinfo(array.dtype).max}], "
                         f"got [{ids.min()}, {ids.max()}]")
    return array
