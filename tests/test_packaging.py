"""What ``pip install .`` puts in site-packages: one top-level name, ``raylastic``, whose every module imports from
there (none reaches for the repository's folders by their own names)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.processes

IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys
import raylastic
assert raylastic.__path__ == [sys.argv[1] + "/raylastic"], raylastic.__path__
modules = [info.name for info in pkgutil.walk_packages(raylastic.__path__, "raylastic.")
           if not info.name.endswith("__main__")]  # the command itself: running it is the next test's
for name in modules:
    importlib.import_module(name)
ours = {"actors", "cluster", "jobconfig", "strategies", "tuning", "workloads"}
assert not ours & {name.split(".")[0] for name in sys.modules}, sorted(ours & set(sys.modules))
print(len(modules), raylastic.train.__module__, raylastic.sweep.__module__)
"""


def _not_the_package(folder: str, names: list[str]) -> set[str]:
    """What the copy leaves out: the checkout's own outputs and caches, and its top-level folders that are not
    part of the package (``actors/data`` is)."""
    left_out = {name for name in names if name.startswith(".") or name.endswith(".egg-info") or name == "__pycache__"}
    if Path(folder) == REPO_ROOT:
        left_out |= {"build", "runs", "data", "benchmarks", "tests"} & set(names)
    return left_out


def test_an_installed_package_is_raylastic_alone_and_every_module_imports_from_it(tmp_path):
    source, target = tmp_path / "source", tmp_path / "site"  # a copy: setuptools writes build/ into its source
    shutil.copytree(REPO_ROOT, source, ignore=_not_the_package)
    built = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                            "--target", str(target), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    assert {path.name for path in target.iterdir()} - {"bin"} == {"raylastic", "raylastic-0.1.0.dist-info"}
    # Run from outside the checkout, the installed copy first on the path: the repository's folders are not found.
    done = subprocess.run([sys.executable, "-c", IMPORT_EVERY_MODULE, str(target)], cwd=tmp_path,
                          env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    count, train_module, sweep_module = done.stdout.split()
    assert int(count) > 100 and train_module == "raylastic.cluster.job" and sweep_module == "raylastic.tuning.tuner"


def test_python_m_raylastic_is_the_command():
    done = subprocess.run([sys.executable, "-m", "raylastic", "--help"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "train" in done.stdout, done.stderr
