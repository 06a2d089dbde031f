"""Where a job's processes import the user's modules from: the driver's working directory, after the standard library.

A workload named ``"my_module:MyWorkload"`` lives where the user runs the command, and every worker must import it
from there too. Ahead of the standard library (as PYTHONPATH, or the head of ``sys.path`` where Ray puts the
driver's directory, would put it), a file there named like a standard module (``queue.py``, ``random.py``,
``types.py``) would replace that module in every process of the job. So the job's runtime env names these
directories in ``RAYLASTIC_IMPORT_PATH`` instead (cluster/connect.py), and the job's setup hook moves them right
after the standard library: still before site-packages, so a user's module wins over an installed package of the
same name, as it does in the driver. Ray itself puts the driver's directory back at the head of ``sys.path`` when
a process takes its first task, after the setup hook has run; so the hook also leaves a finder first on
``sys.meta_path`` that moves the directories back before each top-level import.

Example::

    >>> after_standard_library(["/work", "/py/lib/python3.11", "/venv/site-packages"], ["/work"],
    ...                        ["/py/lib/python3.11"])
    ['/py/lib/python3.11', '/work', '/venv/site-packages']
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import sysconfig
from collections.abc import Sequence
from typing import Any

IMPORT_PATH_VARIABLE = "RAYLASTIC_IMPORT_PATH"
"""The job's import directories, ``os.pathsep``-separated, in the environment of every process Ray starts for it."""
SETUP_HOOK = "raylastic.cluster.import_path.set_up_job_process"
"""The job's ``worker_process_setup_hook``."""
SITE_DIRECTORIES = ("site-packages", "dist-packages")


def after_standard_library(sys_path: Sequence[str], directories: Sequence[str],
                           standard_library: Sequence[str]) -> list[str]:
    """``sys_path`` with every copy of ``directories`` moved to just after its last entry inside
    ``standard_library`` (but not in a site-packages below it); to the end if it has no such entry."""
    moved = list(dict.fromkeys(os.path.normpath(directory) for directory in directories))
    kept = [entry for entry in sys_path if os.path.normpath(entry or os.curdir) not in moved]
    inside = [index for index, entry in enumerate(kept) if _in_standard_library(entry, standard_library)]
    at = inside[-1] + 1 if inside else len(kept)
    return kept[:at] + moved + kept[at:]


def standard_library_directories() -> list[str]:
    """This interpreter's standard library directories (lib-dynload lies inside them)."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(paths[key] for key in ("stdlib", "platstdlib")))


def use_import_path(directories: Sequence[str]) -> None:
    """Put ``directories`` after the standard library on this process's ``sys.path``."""
    sys.path[:] = after_standard_library(sys.path, directories, standard_library_directories())


def set_up_job_process() -> None:
    """The job's setup hook, run by every process Ray starts for the job before it takes work: the directories
    of ``RAYLASTIC_IMPORT_PATH`` after the standard library, kept there by StandardLibraryFirst when Ray puts the
    driver's directory back at the head at the first task; then the training modules imported ahead
    (actors/processes/setup_hook.py)."""
    directories = [entry for entry in os.environ.get(IMPORT_PATH_VARIABLE, "").split(os.pathsep) if entry]
    if directories:
        use_import_path(directories)
        sys.meta_path.insert(0, StandardLibraryFirst(directories))
    from raylastic.actors.processes.setup_hook import (
        import_training_modules,  # torch and the rest, imported with the path in order
    )

    import_training_modules()


class StandardLibraryFirst(importlib.abc.MetaPathFinder):
    """A finder that imports nothing: before each top-level import, it moves ``directories`` back after the
    standard library if ``sys.path`` changed since it last looked (Ray's insertion of the driver's directory)."""

    def __init__(self, directories: Sequence[str]) -> None:
        self.directories = list(directories)
        self._ordered: list[str] = []

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if path is None and sys.path != self._ordered:  # only top-level imports search sys.path
            use_import_path(self.directories)
            self._ordered = list(sys.path)
        return None  # the finders after this one find the module, on the path in order


def _in_standard_library(entry: str, standard_library: Sequence[str]) -> bool:
    path = os.path.normpath(entry)
    for root in standard_library:
        root = os.path.normpath(root)
        if path == root or path.startswith(root + os.sep):
            return not any(part in SITE_DIRECTORIES for part in path[len(root):].split(os.sep))
    return False
