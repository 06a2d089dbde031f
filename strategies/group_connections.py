"""The TCP connections of this process's gloo groups, found so that they can be shut down whatever is in flight.

A gloo group, when destroyed, first waits for its collectives still running. One that waits on a live peer ends
only when that peer's connections close, and the peer's own collective may wait on this one: a cycle that only
the group's timeout (failure.collective_timeout_s) ends, and it forms easily in a large group. torch has no call
that closes a gloo group's connections (ProcessGroupGloo's ``abort()`` and ``shutdown()`` leave them open), so
they are found by what forming the groups opened: every TCP connection gloo's full mesh made or accepted (not
its listening sockets: gloo's event loop aborts the process on a shut listener). A member that leaves shuts
them down, which ends the collectives on both ends at once.

Linux only (``/proc``); elsewhere none are found and a group is destroyed as before::

    connections = GroupConnections()
    with connections.forming():
        dist.init_process_group("gloo", ...)    # and the generation's dist.new_group calls
    ...
    connections.shut_down()                     # then destroy the groups: nothing of theirs is left waiting
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

LISTENING = "0A"
"""The state column of /proc/net/tcp for a listening socket."""


class GroupConnections:
    def __init__(self) -> None:
        self._sockets: list[tuple[int, int]] = []
        """(file descriptor, socket inode) of the connections the groups' formation opened."""

    @contextlib.contextmanager
    def forming(self) -> Iterator[None]:
        """Around the creation of groups: keeps every TCP connection opened meanwhile, except those accepted by a
        server that listened before (Ray's: a caller's first call). Open the connections this process needs to
        Ray's actors during the formation (the run's keys) before it: they would be taken for the groups'."""
        before = _tcp_sockets()
        serving = {port for _, port, state in before.values() if state == LISTENING}
        yield
        self._sockets += [(fd, inode) for inode, (fd, port, state) in _tcp_sockets().items()
                          if inode not in before and state != LISTENING and port not in serving]

    def shut_down(self) -> None:
        """Shut down (both ways) every socket kept since the last call that this process still holds: the
        collectives on them raise here and at their peers at once."""
        for fd, inode in self._sockets:
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != f"socket:[{inode}]":
                    continue  # closed with its group since; the number may be another file's now
                duplicate = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                duplicate.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already shut down, or never connected
            finally:
                duplicate.close()
        self._sockets = []


def _tcp_sockets() -> dict[int, tuple[int, int, str]]:
    """This process's TCP sockets: inode -> (file descriptor, local port, state)."""
    descriptors = {}
    with contextlib.suppress(OSError):
        for entry in Path("/proc/self/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(entry)
                if target.startswith("socket:["):
                    descriptors[int(target[8:-1])] = int(entry.name)
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                inode = int(fields[9])
                if inode in descriptors:
                    found[inode] = (descriptors[inode], int(fields[1].rsplit(":", 1)[1], 16), fields[3])
    return found
