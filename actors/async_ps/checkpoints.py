"""The parameter servers' checkpoints on disk: names, which cuts are whole, which to keep, which to clear.

Every ``checkpoint.every_steps`` updates each server writes its share to
``<root>/ps_<version>/server_<index>_of_<count>.<lineage>.pt``. The lineage names the epoch that wrote it (a tag
chosen at every restore, later ones sorting higher): after a restore the servers' timeline goes back, and a new
epoch writes the same versions again. A cut is whole only when every index < count has a file of the same
lineage in one directory, so files that two epochs wrote never make one cut (issue 29). Only our own files
are ever deleted: the server files and their ``.tmp``, then the directory if nothing else is left in it::

    newest_complete("runs/x/checkpoints")   # Cut(".../ps_00000100", version=100, lineage="18f3a...", num_servers=2)
    clear_after("runs/x/checkpoints", 50)   # a restore to version 50: the abandoned timeline's files go
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import fsspec

CHECKPOINT_PREFIX = "ps_"
_DIRECTORY = re.compile(rf"{CHECKPOINT_PREFIX}(\d+)$")
_SERVER_FILE = re.compile(r"server_(\d+)_of_(\d+)(?:\.([0-9a-f]+))?\.pt(\.tmp)?$")
"""index, count, lineage (none in files written before lineages existed), and a write not yet renamed."""


@dataclass(frozen=True)
class Cut:
    """One whole checkpoint: the files of ``num_servers`` servers of one lineage at ``version``."""

    directory: str
    version: int
    lineage: str
    num_servers: int

    def files(self) -> list[str]:
        return [server_file(self.directory, index, self.num_servers, self.lineage) for index in range(self.num_servers)]


def checkpoint_dir(root: str, version: int) -> str:
    return f"{root.rstrip('/')}/{CHECKPOINT_PREFIX}{version:08d}"


def server_file(directory: str, index: int, num_servers: int, lineage: str) -> str:
    tag = f".{lineage}" if lineage else ""
    return f"{directory}/server_{index}_of_{num_servers}{tag}.pt"


def complete_checkpoints(root: str) -> list[Cut]:
    """Every whole cut under ``root``, oldest first (in a directory with several, the newest lineage's)."""
    found = [_whole_cut(directory, version, names) for directory, version, names in _directories(root)]
    return sorted((cut for cut in found if cut is not None), key=lambda cut: cut.version)


def cut_in(directory: str) -> Cut | None:
    """The whole cut in ``directory`` if it is a ``ps_<version>`` directory (the newest lineage's), else None; a
    ``ps_<version>`` directory without every server's file of one lineage raises ValueError naming what it holds."""
    match = _DIRECTORY.match(_basename(directory))
    if match is None:
        return None
    fs, path = fsspec.core.url_to_fs(directory)
    names = [_basename(child) for child in fs.ls(path, detail=False)] if fs.isdir(path) else []
    cut = _whole_cut(directory.rstrip("/"), int(match.group(1)), names)
    if cut is None:
        raise ValueError(f"{directory} is not a whole parameter-server checkpoint: it needs server_<i>_of_<n>.<lineage>"
                         f".pt for every i < n of one lineage, and holds {sorted(names) or 'nothing'}")
    return cut


def _whole_cut(directory: str, version: int, names: list[str]) -> Cut | None:
    """The cut of ``directory``'s files ``names`` whose every server's file is there (the newest lineage's), if any."""
    files: dict[tuple[str, int], set[int]] = {}
    for name in names:
        match = _SERVER_FILE.match(name)
        if match and not match.group(4):
            files.setdefault((match.group(3) or "", int(match.group(2))), set()).add(int(match.group(1)))
    whole = [key for key, indices in files.items() if indices == set(range(key[1]))]
    if not whole:
        return None
    lineage, count = max(whole)
    return Cut(directory, version, lineage, count)


def newest_complete(root: str, excluding: frozenset[Cut] = frozenset()) -> Cut | None:
    """The newest whole cut that is not in ``excluding`` (cuts found unreadable)."""
    found = [cut for cut in complete_checkpoints(root) if cut not in excluding]
    return found[-1] if found else None


def last_checkpoint_note(root: str) -> str:
    """What an error adds about the checkpoints under ``root``: the newest whole one, or that there is none."""
    found = newest_complete(root)
    if found is None:
        return "; no checkpoint was written yet"
    return f"; last checkpoint: {found.directory} (update {found.version})"


def prune(root: str, keep: int) -> None:
    """Keep the ``keep`` newest whole cuts; clear older directories, whole or not (no server writes there again)."""
    found = complete_checkpoints(root)
    if not found:
        return
    kept, newest = {cut.directory for cut in found[-keep:]}, found[-1].version
    for directory, version, names in _directories(root):
        if directory not in kept and version < newest:
            _clear(directory, names)


def clear_after(root: str, version: int) -> None:
    """The servers were restored to ``version``: clear every directory of a later version (files of the abandoned
    timeline, whole or half written)."""
    for directory, found_version, names in _directories(root):
        if found_version > version:
            _clear(directory, names)


def _directories(root: str) -> list[tuple[str, int, list[str]]]:
    """(directory, version, the names in it) for every ``ps_<version>`` directory under ``root``."""
    fs, path = fsspec.core.url_to_fs(root)
    if not fs.exists(path):
        return []
    found = []
    for entry in fs.ls(path, detail=True):
        name = _basename(entry["name"])
        match = _DIRECTORY.match(name)
        if match and entry["type"] == "directory":
            names = [_basename(child) for child in fs.ls(entry["name"], detail=False)]
            found.append((f"{root.rstrip('/')}/{name}", int(match.group(1)), names))
    return found


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _clear(directory: str, names: list[str]) -> None:
    """Delete our server files in ``directory``, then the directory if that left it empty (anything else stays)."""
    fs, path = fsspec.core.url_to_fs(directory)
    for name in names:
        if _SERVER_FILE.match(name):
            with contextlib.suppress(FileNotFoundError):
                fs.rm(f"{path}/{name}")
    if not fs.ls(path, detail=False):
        with contextlib.suppress(OSError):
            fs.rmdir(path)
