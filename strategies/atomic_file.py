"""A local file replaced whole or not at all, and durably: the new contents go to a temporary file beside it
(``<name>.<pid>.<ns>.tmp``), flushed and fsync'd, which is renamed over it; then its directory is fsync'd, so that
the rename itself survives a power loss. A write that fails (a full disk, an object that cannot be saved) leaves the
file that was there, and no temporary file.

Example::

    write_atomically("runs/x/model.pt", lambda handle: torch.save(state, handle))
    write_atomically("runs/x/result.json", lambda handle: handle.write(text.encode()))
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Replace ``path`` with what ``write`` writes into the open binary file it is given; returns ``path``."""
    path = Path(path)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.{time.time_ns()}.tmp")
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return path


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make the names in ``directory`` (a file just renamed into it) durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
