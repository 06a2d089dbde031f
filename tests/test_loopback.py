"""Laptop mode is reachable from nowhere: the local Ray that ``train()`` starts (conftest's ``ray_local`` starts it
the same way, through cluster.connect.ray_session) and every process of its runs listen on loopback only, so a
client arriving on the machine's own network address finds no port open, and the run is not disturbed."""

from __future__ import annotations

import socket

import psutil
import pytest
import ray

from raylastic.cluster.job import train
from raylastic.cluster.loopback import is_loopback, loopback_interface, network_address
from tests.support.distributed_harness import run_distributed
from tests.support.helpers import assert_states_close, job, load_model
from tests.support.strategy_runs import train_job_alone

pytestmark = pytest.mark.usefixtures("ray_local")


def our_processes() -> list[psutil.Process]:
    """This process and the processes it started: the local Ray's GCS, raylet, agents and workers, the runs'
    Controllers and ranks."""
    return [psutil.Process(), *psutil.Process().children(recursive=True)]


def listening_addresses(processes: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process name, host, port) of every TCP socket listening in one of ``processes``."""
    found = []
    for process in processes:
        try:
            name = process.name()
            connections = process.net_connections(kind="tcp")
        except psutil.Error:  # ended meanwhile
            continue
        found += [(name, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
    return found


def answers(host: str, port: int) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted (and then fed what a TCPStore client sends first)."""
    try:
        with socket.create_connection((host, port), timeout=5) as connection:
            connection.sendall(b"\x00" * 16)
            return True
    except OSError:
        return False


def listener_pid(host: str, port: int) -> int | None:
    """The process listening where a connection to ``host:port`` lands: another Ray instance on this machine
    (a parallel test's, a user's) may hold the same port on the network address while ours holds it on
    loopback, and reaching that one says nothing about this run."""
    for connection in psutil.net_connections(kind="tcp"):
        if (connection.status == psutil.CONN_LISTEN and connection.laddr.port == port
                and connection.laddr.ip in (host, "0.0.0.0", "::")):
            return connection.pid
    return None


def test_every_listener_of_the_local_ray_and_its_run_is_on_loopback_and_the_network_finds_none(tmp_path):
    assert is_loopback(ray.util.get_node_ip_address())
    seen: list[list[tuple[str, str, int]]] = []
    reached: list[tuple[str, int]] = []
    address = network_address()

    def probe(progress) -> None:
        if progress.state == "running" and not seen:
            processes = our_processes()
            seen.append(listening_addresses(processes))
            ours = {process.pid for process in processes}
            if address is not None:
                reached.extend((name, port) for name, _, port in seen[0]
                               if answers(address, port) and listener_pid(address, port) in ours)

    probed = train(job(name="loopback-probed"), run_dir=tmp_path / "probed", on_progress=probe)
    assert seen, "the run was never seen running"
    listeners = seen[0]
    names = {name for name, _, _ in listeners}
    assert {"gcs_server", "raylet"} <= names and len(listeners) >= 5, listeners  # not vacuous
    assert [entry for entry in listeners if not is_loopback(entry[1])] == []
    assert probed.final_step == 20
    alone = run_distributed(train_job_alone, 1, job(name="loopback-alone"), timeout_s=300)[0]
    assert_states_close(load_model(tmp_path / "probed"), alone)  # the probe changed nothing
    if address is None:
        pytest.skip("this machine has no network address to arrive on")  # every check above still ran
    assert reached == [], f"reached from {address}: {reached}"


def test_gloo_and_nccl_are_told_the_loopback_interface():
    @ray.remote(num_cpus=0)
    def interfaces() -> tuple[str | None, str | None]:
        import os
        return os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")

    assert ray.get(interfaces.remote(), timeout=120) == (loopback_interface(), loopback_interface())
