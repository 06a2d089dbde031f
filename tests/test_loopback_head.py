"""Laptop mode with a head is reachable from nowhere: the README's head (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start
--head ... --dashboard-host 127.0.0.1``, one of this module's own, stopped by its pid) and ``raylastic train --address
auto`` against it. While the run trains, every TCP socket listening in the head's processes (GCS, raylet, agents, the
Controller and the ranks) and in the driver's is on loopback, and the ranks were told the loopback interface for gloo
and NCCL (on a machine whose hostname resolves to a network address, gloo listens there otherwise).

    python -m pytest tests/test_loopback_head.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from raylastic.cluster.loopback import is_loopback, loopback_interface, nodes_off_loopback
from tests.support.ray_head import RayHead, start_head, stop_head

REPO_ROOT = Path(__file__).resolve().parent.parent
LAPTOP_HEAD_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_worker_niceness": "0"}
"""The README's laptop head: Ray's cluster mode off, so its node IP, and every service's, is 127.0.0.1."""
RUN_TIMEOUT_S = 240.0
RANK = "TrainWorkerProcess"
"""What a rank's process title names (``ray::TrainWorkerProcess...``)."""

pytestmark = pytest.mark.processes  # a Ray head of its own, and the run on it


@pytest.fixture(scope="module")
def laptop_head():
    head = start_head(num_cpus=2, extra_env=LAPTOP_HEAD_ENV)
    try:
        yield head
    finally:
        stop_head(head)


def listeners_and_ranks(roots: list[int], ranks: dict[int, dict[str, str]]) -> set[tuple[str, str, int]]:
    """(process name, host, port) of every TCP socket listening in ``roots`` and their descendants, a rank's process
    named "rank"; each rank's process environment is added to ``ranks`` (by pid)."""
    tree: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            tree |= {p.pid: p for p in (psutil.Process(root), *psutil.Process(root).children(recursive=True))}
        except psutil.NoSuchProcess:
            continue
    names: dict[int, str] = {}
    for pid, process in tree.items():
        try:
            if pid in ranks or RANK in " ".join(process.cmdline()):
                if pid not in ranks:
                    ranks[pid] = process.environ()
                names[pid] = "rank"
            else:
                names[pid] = process.name()
        except psutil.Error:  # ended meanwhile
            continue
    return {(names[c.pid], c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in names}


def test_a_run_on_the_readmes_laptop_head_listens_on_loopback_only_ranks_included(laptop_head: RayHead, tmp_path):
    assert laptop_head.gcs_address.startswith("127.0.0.1:"), laptop_head.gcs_address
    command = [sys.executable, "-m", "raylastic", "train", "--address", "auto", "--run-dir", str(tmp_path),
               "--set", "name=laptop", "--set", "workload.name=tests.support.user_workload:SlowDigits",
               "--set", "workload.options={pause_s: 0.05}", "--set", "training.steps=40",
               "--set", "training.global_batch_size=48", "--set", "scaling.min_workers=2",
               "--set", "scaling.max_workers=2", "--set", "scaling.cpus_per_worker=0.5"]
    listeners: set[tuple[str, str, int]] = set()
    ranks: dict[int, dict[str, str]] = {}
    with open(tmp_path / "driver.log", "w") as log:
        driver = subprocess.Popen(command, cwd=REPO_ROOT, env=laptop_head.client_env(), stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while driver.poll() is None and time.monotonic() < deadline:
            listeners |= listeners_and_ranks([laptop_head.process.pid, driver.pid], ranks)
            time.sleep(0.5)
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.wait(timeout=30)
    output = (tmp_path / "driver.log").read_text()
    assert driver.returncode == 0, output[-3000:]
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "finished"
    names = {name for name, _, _ in listeners}
    assert {"gcs_server", "raylet", "rank"} <= names and len(ranks) >= 2, (names, list(ranks))  # not vacuous
    assert sorted(entry for entry in listeners if not is_loopback(entry[1])) == []
    interface = loopback_interface()
    assert {pid: (env.get("GLOO_SOCKET_IFNAME"), env.get("NCCL_SOCKET_IFNAME")) for pid, env in ranks.items()} == \
        dict.fromkeys(ranks, (interface, interface))


def test_nodes_off_loopback_names_the_live_nodes_elsewhere():
    nodes = [{"NodeManagerAddress": "127.0.0.1", "Alive": True}, {"NodeManagerAddress": "10.0.0.7", "Alive": True},
             {"NodeManagerAddress": "10.0.0.8", "Alive": False}]
    assert nodes_off_loopback(nodes) == ["10.0.0.7"] and nodes_off_loopback(nodes[:1]) == []
