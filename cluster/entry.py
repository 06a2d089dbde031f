"""The script ``ray submit`` runs on the head node: the ``raylastic`` command, on the cluster it runs in.

    ray submit cluster.yaml cluster/entry.py -- train --config examples/digits_elastic.yaml
    ray submit cluster.yaml cluster/entry.py -- status
    python cluster/entry.py train --set training.steps=50      # the same, on any node of a cluster

``ray submit`` copies this file to ``~/entry.py`` on the head and runs ``python ~/entry.py ARGS``
from the home directory. So the script finds the repository itself: ``RAYLASTIC_HOME`` if set,
else the checkout it sits in, else ``~/raylastic`` (where cluster.yaml's file_mounts put it).
``train`` connects with ``--address auto`` unless told otherwise, and the exit code is the
command's: 0 done, 1 the run failed (the reason is printed), 2 bad configuration.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def find_repository() -> Path | None:
    """The Raylastic checkout to run: RAYLASTIC_HOME, this file's checkout, or ~/raylastic."""
    candidates = [os.environ.get("RAYLASTIC_HOME"), HERE.parent, Path.home() / "raylastic"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "cluster" / "cli.py").is_file():
            return Path(candidate).resolve()
    return None


def with_default_address(argv: list[str]) -> list[str]:
    """``train`` without ``--address`` joins the cluster it runs in instead of starting a new Ray."""
    if argv[:1] == ["train"] and not any(a == "--address" or a.startswith("--address=") for a in argv):
        return [*argv, "--address", "auto"]
    return argv


def main(argv: list[str] | None = None) -> int:
    if (HERE / "cli.py").is_file() and sys.path and Path(sys.path[0] or ".").resolve() == HERE:
        sys.path.pop(0)  # run as cluster/entry.py: the package's modules must not shadow top-level names
    repository = find_repository()
    if repository is not None:
        sys.path.insert(0, str(repository))
        # The workers import the package (and a user's workload) from the same checkout.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(repository), os.environ.get("PYTHONPATH")) if p)
    try:
        from raylastic.cluster.cli import main as raylastic
    except ImportError as error:
        print(f"error: cannot import raylastic ({error}); put the repository at ~/raylastic (cluster.yaml's "
              "file_mounts do) or set RAYLASTIC_HOME", file=sys.stderr)
        return 1
    try:
        return raylastic(with_default_address(sys.argv[1:] if argv is None else argv))
    except ConnectionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
