"""The parameter servers' checkpoints: which directories are complete, which to keep.

A directory ``ps_<version>`` is complete when it holds ``server_<i>_of_<n>.pt`` for every i < n (the
servers write at the same versions, each its own file, atomically)::

    newest_complete("runs/x/checkpoints")      # ("runs/x/checkpoints/ps_00000100", 100), or None
"""

from __future__ import annotations

import re

import fsspec

from actors.async_ps.server import CHECKPOINT_PREFIX

_SERVER_FILE = re.compile(r"server_(\d+)_of_(\d+)\.pt$")


def complete_checkpoints(root: str) -> list[tuple[str, int]]:
    """Every complete checkpoint under ``root`` as (directory, version), oldest first."""
    fs, path = fsspec.core.url_to_fs(root)
    if not fs.exists(path):
        return []
    found = []
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if not (name.startswith(CHECKPOINT_PREFIX) and name[len(CHECKPOINT_PREFIX):].isdigit()):
            continue
        files = [_SERVER_FILE.search(f) for f in fs.ls(entry, detail=False)]
        counts = {int(m.group(2)) for m in files if m}
        indices = {int(m.group(1)) for m in files if m}
        if len(counts) == 1 and indices == set(range(counts.pop())):
            found.append((f"{root.rstrip('/')}/{name}", int(name[len(CHECKPOINT_PREFIX):])))
    return sorted(found, key=lambda item: item[1])


def newest_complete(root: str) -> tuple[str, int] | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def prune(root: str, keep: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints."""
    found = complete_checkpoints(root)
    if len(found) <= keep:
        return
    fs, _ = fsspec.core.url_to_fs(root)
    for directory, _ in found[:-keep]:
        fs.rm(directory, recursive=True)
