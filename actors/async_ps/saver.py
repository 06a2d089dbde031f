"""A parameter server's checkpoint writes, on a thread of their own.

When an update makes a save due, the server hands a copy of its share (parameters, optimizer and prediction
state) to this saver and goes on applying updates and answering heartbeats while the file is written: a write
slower than ``failure.step_timeout_s`` no longer makes a healthy server look hung (issue 29). One file is
written at a time; a save that comes due meanwhile waits, and a newer one takes its place (the one it replaces
is reported as not written). Failed writes wait for the server's next heartbeat, which carries them to the
Controller (``checkpoint_failed`` events). A restore waits for the file being written for a bounded time only
(``reset``): a write stuck on a dead mount makes it raise ``SaveStillWriting``, and the Controller replaces the
server, whose process takes the write with it::

    saver = ServerSaver()
    saver.submit(Snapshot(version=10, path=".../ps_00000010/server_0_of_1.<lineage>.pt", payload={...}))
    saver.written              # 10 once that file is in place
    saver.take_failures()      # e.g. [SaveFailure(10, ".../server_0_of_1.<lineage>.pt", "OSError: [Errno 28] ...")]
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import fsspec
import torch


@dataclass(frozen=True)
class Snapshot:
    version: int
    path: str
    payload: dict[str, Any]
    """A copy: the server changes its own tensors while this is written."""


class SaveStillWriting(TimeoutError):
    """A restore found a save of the epoch before still being written after its bound: the server cannot start a
    new epoch with an old file still to come, and is replaced."""


@dataclass(frozen=True)
class SaveFailure:
    version: int
    path: str
    error: str


class ServerSaver:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._waiting: Snapshot | None = None
        self._writing: Snapshot | None = None
        self._failures: list[SaveFailure] = []
        self.written = 0
        """The newest version written by this epoch (or restored: its files exist)."""
        threading.Thread(target=self._write_forever, name="checkpoint-writer", daemon=True).start()

    def submit(self, snapshot: Snapshot) -> None:
        """Write ``snapshot`` after the file being written now, in place of any save still waiting."""
        with self._changed:
            if self._waiting is not None:
                writing = self._writing.version if self._writing else "an earlier version"
                self._failures.append(SaveFailure(self._waiting.version, self._waiting.path, (
                    f"not written: version {snapshot.version} was due while the save of {writing} was still being "
                    "written (saves take longer than checkpoint.every_steps updates)")))
            self._waiting = snapshot
            self._changed.notify_all()

    def reset(self, written: int, timeout_s: float) -> None:
        """A restore: drop the save waiting, let the file being written end, then count ``written`` as written.
        SaveStillWriting, naming the file, if it has not ended within ``timeout_s``."""
        with self._changed:
            self._waiting = None
            if not self._changed.wait_for(lambda: self._writing is None, timeout=timeout_s):
                raise SaveStillWriting(f"the save of version {self._writing.version} to {self._writing.path} was "
                                       f"still being written {timeout_s:g}s into the restore")
            self.written = written

    @property
    def writing(self) -> int | None:
        """The version whose file is being written now (None: none is)."""
        with self._changed:
            return self._writing.version if self._writing else None

    def take_failures(self) -> list[SaveFailure]:
        """The failed saves not yet taken."""
        with self._changed:
            failures, self._failures = self._failures, []
            return failures

    def _write_forever(self) -> None:
        while True:
            with self._changed:
                while self._waiting is None:
                    self._changed.wait()
                snapshot, self._waiting, self._writing = self._waiting, None, self._waiting
            try:
                write_atomically(snapshot.path, snapshot.payload)
                failure = None
            except Exception as error:  # noqa: BLE001 - fsspec's backends raise their own kinds; reported, not fatal
                failure = SaveFailure(snapshot.version, snapshot.path, f"{type(error).__name__}: {error}")
            with self._changed:
                self._writing = None
                if failure is None:
                    self.written = snapshot.version
                else:
                    self._failures.append(failure)
                self._changed.notify_all()


def write_atomically(path: str, payload: dict[str, Any]) -> None:
    """``payload`` to ``path`` by way of ``<path>.tmp``: a reader sees the whole file or none."""
    fs, local = fsspec.core.url_to_fs(path)
    fs.makedirs(local.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(f"{local}.tmp", "wb") as handle:
        torch.save(payload, handle)
    fs.mv(f"{local}.tmp", local)
