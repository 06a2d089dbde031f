"""Is a token file what its dtype and vocabulary say? Checked when a ``TokenBlocks`` is made.

At the start, up to ``CHECK_PIECES`` pieces of ``CHECK_PIECE_TOKENS`` tokens spread over the file are read
(all of a file of up to 16 M tokens: ~0.05 s from the page cache), so a wrong dtype or vocabulary is refused
before training without reading a corpus of many gigabytes on every worker's start; ``TokenBlocks`` then
checks every window it fetches, which is what guarantees the model never sees an id out of its vocabulary.

Example::

    check_token_file("data/stdlib/train.bin", "uint16", vocab_size=256)   # raises TokenFileError, or None
"""

from __future__ import annotations

import os

import numpy as np

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
CHECK_PIECES = 16
CHECK_PIECE_TOKENS = 1 << 20
UINT32_SIGN_MIN_TOKENS = 64
"""Fewer tokens checked are too few to tell uint32 ids read as uint16 by their zero high halves."""


class TokenFileError(ValueError):
    """A token file that does not hold what its dtype and vocabulary say: its size, its ids or its layout."""


def check_token_file(path: str | os.PathLike, dtype: str, vocab_size: int | None = None) -> None:
    """Raise TokenFileError if ``path``, read as ``dtype``, holds an id at or above ``vocab_size``, or looks like
    uint32 ids read as uint16 (every second value 0), in the pieces checked at the start (module docstring).

    Example::

        check_token_file("data/stdlib/train.bin", "uint16", 256)  # None: fine
    """
    if os.path.getsize(path) == 0:
        return  # nothing to check, and numpy cannot map an empty file
    tokens = np.memmap(path, dtype=numpy_dtype(dtype), mode="r")
    try:
        checked, nonzero_at = 0, [False, False]  # per parity of the position: any nonzero value there
        for start in _check_starts(len(tokens)):
            piece = np.asarray(tokens[start:start + CHECK_PIECE_TOKENS])
            if vocab_size is not None and piece.size and piece.max() >= vocab_size:
                position = start + int(np.argmax(piece >= vocab_size))
                raise TokenFileError(out_of_vocabulary(path, dtype, vocab_size, int(tokens[position]), position))
            checked += piece.size
            nonzero_at = [nonzero_at[0] or bool(piece[0::2].any()), nonzero_at[1] or bool(piece[1::2].any())]
    finally:
        del tokens  # unmaps the file
    if dtype == "uint16" and checked >= UINT32_SIGN_MIN_TOKENS and nonzero_at[0] != nonzero_at[1]:
        raise TokenFileError(f"{path}: read as uint16, every second value of the {checked} tokens checked is 0: "
                             "the file holds uint32 token ids (their high halves are the zeros); give the dtype it "
                             "was written with (meta.json's dtype: uint32)")


def _check_starts(num_tokens: int) -> list[int]:
    """Where the pieces checked at the start begin: the whole file if it is small, else spread over it (even
    positions, so a piece starts on a uint32 id's first half as the file does)."""
    if num_tokens <= CHECK_PIECES * CHECK_PIECE_TOKENS:
        return list(range(0, num_tokens, CHECK_PIECE_TOKENS))
    last = num_tokens - CHECK_PIECE_TOKENS
    return [int(start) // 2 * 2 for start in np.linspace(0, last, CHECK_PIECES)]


def out_of_vocabulary(path: str | os.PathLike, dtype: str, vocab_size: int, token_id: int, position: int) -> str:
    hint = " (uint16 ids read as uint32?)" if dtype == "uint32" and token_id > np.iinfo(np.uint16).max else ""
    return (f"{path}: token {position} is {token_id}, not below the vocabulary size {vocab_size}{hint}; "
            f"the file, read as {dtype}, must hold ids 0..{vocab_size - 1}")


def numpy_dtype(dtype: str) -> type:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]
